//! Load generation against the control plane: N concurrent gRPC clients issuing
//! spawn / exec / kill mixes, latencies in HDR histograms, reported as a table and JSON.

pub mod null_executor;
pub mod report;
pub mod run;
pub mod split;
