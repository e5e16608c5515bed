//! Retries with exponential backoff for whole remote operations.
//!
//! object_store retries individual HTTP requests itself, but not a GET whose
//! body stream breaks halfway, nor a request that exhausted its own retries
//! during a brief outage; this layer retries the whole operation on errors
//! that can plausibly succeed later and gives up at once on the rest.

use std::future::Future;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Total attempts, including the first.
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// NotFound, AlreadyExists, Precondition, permission and path errors are
/// answers, not hiccups; Generic (network, 5xx after object_store's own
/// retries, broken bodies) and JoinError are worth another try.
pub fn is_transient(e: &object_store::Error) -> bool {
    matches!(
        e,
        object_store::Error::Generic { .. } | object_store::Error::JoinError { .. }
    )
}

impl RetryPolicy {
    pub async fn run<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, object_store::Error>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, object_store::Error>>,
    {
        let mut backoff = self.initial_backoff;
        let mut attempt = 1;
        loop {
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if attempt < self.max_attempts && is_transient(&e) => {
                    tracing::warn!(attempt, %e, "{what} failed, retrying in {backoff:?}");
                    tokio::time::sleep(jitter(backoff)).await;
                    backoff = (backoff * 2).min(self.max_backoff);
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// ±25 % so parallel transfers that failed together do not retry in lockstep.
fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    let factor = 0.75 + f64::from(nanos % 1000) / 2000.0;
    d.mul_f64(factor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn generic() -> object_store::Error {
        object_store::Error::Generic {
            store: "test",
            source: "connection reset".into(),
        }
    }

    #[tokio::test]
    async fn retries_transient_then_succeeds() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(1),
            ..Default::default()
        };
        let out = policy
            .run("op", || async {
                if calls.fetch_add(1, Ordering::SeqCst) < 2 {
                    Err(generic())
                } else {
                    Ok(7)
                }
            })
            .await
            .unwrap();
        assert_eq!((out, calls.load(Ordering::SeqCst)), (7, 3));
    }

    #[tokio::test]
    async fn gives_up_on_permanent_and_after_max_attempts() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(1),
            ..Default::default()
        };
        let err = policy
            .run("op", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(object_store::Error::NotFound {
                    path: "x".into(),
                    source: "gone".into(),
                })
            })
            .await
            .unwrap_err();
        assert!(matches!(err, object_store::Error::NotFound { .. }));
        assert_eq!(calls.swap(0, Ordering::SeqCst), 1);
        policy
            .run("op", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(generic())
            })
            .await
            .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }
}
