//! Tine executor daemon.
