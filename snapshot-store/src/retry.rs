//! Retries with exponential backoff for whole remote operations.
//!
//! object_store retries individual HTTP requests itself, but not a GET whose
//! body stream breaks halfway, nor a request that exhausted its own retries
//! during a brief outage; this layer retries the whole operation on errors
//! that can plausibly succeed later and gives up at once on the rest.
//!
//! Every operation is bounded in time as well as in attempts: `max_elapsed`
//! covers attempts and backoff alike, and an attempt still running when it
//! runs out is abandoned, so a store that accepts connections and then says
//! nothing cannot hold a caller for longer than that.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Total attempts, including the first.
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Hard budget for one operation, all attempts and backoff included.
    pub max_elapsed: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        // A refused connection fails in milliseconds, so five attempts cost a
        // few seconds; a silent endpoint is cut off at 30 s, about what a
        // person waiting on a spawn tolerates before wanting an answer.
        RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            max_elapsed: Duration::from_secs(30),
        }
    }
}

/// How an operation failed, and how hard it tried.
#[derive(Debug)]
pub struct Failure {
    /// The last attempt's error.
    pub error: object_store::Error,
    pub attempts: u32,
    pub elapsed: Duration,
}

/// NotFound, AlreadyExists, Precondition, permission and path errors are
/// answers, not hiccups; so is an HTTP 3xx/4xx other than 408/429 (bad
/// region, malformed request). Generic (network, timeouts, 5xx after
/// object_store's own retries, broken bodies) and JoinError are worth
/// another try.
pub fn is_transient(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::Generic { .. } => !is_refusal(e),
        object_store::Error::JoinError { .. } => true,
        _ => false,
    }
}

/// The store answered, and the answer was "no" for a reason that repeating
/// the request cannot change.
///
/// object_store 0.14 keeps its request error type private, so this reads the
/// messages of the error chain (`RequestError`'s Display). Should that text
/// change, the error counts as transient: retried, then reported as
/// unavailable, which is the behaviour before this check existed.
fn is_refusal(e: &object_store::Error) -> bool {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if text.starts_with("Received redirect without LOCATION") {
            return true;
        }
        if let Some(rest) = text.strip_prefix("Server returned non-2xx status code: ") {
            return match rest.get(..3).and_then(|s| s.parse::<u16>().ok()) {
                Some(408 | 429) => false,
                Some(code) => (300..500).contains(&code),
                None => false,
            };
        }
        cur = err.source();
    }
    false
}

/// The error an attempt gets when the operation's budget runs out under it.
fn budget_exhausted(budget: Duration) -> object_store::Error {
    object_store::Error::Generic {
        store: "tine",
        source: Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer within the operation's {budget:?} budget"),
        )),
    }
}

impl RetryPolicy {
    /// Runs `op` until it succeeds, fails permanently, runs out of attempts
    /// or runs out of time.
    pub async fn run<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, Failure>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, object_store::Error>>,
    {
        let start = Instant::now();
        let deadline = start + self.max_elapsed;
        let mut backoff = self.initial_backoff;
        let mut attempt = 1;
        loop {
            let result = match tokio::time::timeout_at(deadline, op()).await {
                Ok(r) => r,
                Err(_) => Err(budget_exhausted(self.max_elapsed)),
            };
            let e = match result {
                Ok(v) => return Ok(v),
                Err(e) => e,
            };
            let pause = jitter(backoff);
            // A retry that could not start before the deadline is not made.
            if attempt >= self.max_attempts
                || !is_transient(&e)
                || Instant::now() + pause >= deadline
            {
                return Err(Failure {
                    error: e,
                    attempts: attempt,
                    elapsed: start.elapsed(),
                });
            }
            tracing::warn!(attempt, %e, "{what} failed, retrying in {pause:?}");
            tokio::time::sleep(pause).await;
            // The timer can wake a little late: past the deadline, no further attempt.
            if Instant::now() >= deadline {
                return Err(Failure {
                    error: e,
                    attempts: attempt,
                    elapsed: start.elapsed(),
                });
            }
            backoff = (backoff * 2).min(self.max_backoff);
            attempt += 1;
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
        assert!(matches!(err.error, object_store::Error::NotFound { .. }));
        assert_eq!((err.attempts, calls.swap(0, Ordering::SeqCst)), (1, 1));
        let err = policy
            .run("op", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(generic())
            })
            .await
            .unwrap_err();
        assert_eq!((err.attempts, calls.load(Ordering::SeqCst)), (3, 3));
    }

    #[tokio::test]
    async fn an_attempt_that_never_answers_is_cut_at_the_budget() {
        let policy = RetryPolicy {
            max_attempts: 100,
            initial_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(1),
            max_elapsed: Duration::from_millis(300),
        };
        let t = std::time::Instant::now();
        let err = policy
            .run("op", || async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok::<(), _>(())
            })
            .await
            .unwrap_err();
        let took = t.elapsed();
        assert!(is_transient(&err.error), "{}", err.error);
        assert!(err.error.to_string().contains("budget"), "{}", err.error);
        assert_eq!(err.attempts, 1);
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn backoff_never_sleeps_past_the_budget() {
        let calls = AtomicU32::new(0);
        let policy = RetryPolicy {
            max_attempts: 100,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            max_elapsed: Duration::from_millis(500),
        };
        let t = std::time::Instant::now();
        let err = policy
            .run("op", || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(generic())
            })
            .await
            .unwrap_err();
        // 0 ms, ~200 ms, then ~400 ms more would cross 500 ms: two attempts (three when the
        // jitter makes both pauses short). A sleep may end a timer tick late, hence the slack.
        assert!(
            t.elapsed() < Duration::from_millis(525),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(err.attempts, calls.load(Ordering::SeqCst));
        assert!((2..=3).contains(&err.attempts), "{}", err.attempts);
    }
}
