//! Paging of List calls: a page is the entries after a cursor in a stable order, and the
//! token for the next page is that cursor, tied to the list (and filter) it came from, so a
//! token cannot be replayed against another list.

use serde::{Deserialize, Serialize};
use tonic::Status;

/// Entries per page when a call does not say.
pub const DEFAULT_PAGE_SIZE: u32 = 500;
/// The most entries a page may hold.
pub const MAX_PAGE_SIZE: u32 = 1000;

/// Where a page starts: after the entry with this sort key (creation time, then name).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub created_ms: i64,
    pub key: String,
}

/// What a List call asked for.
#[derive(Debug, PartialEq, Eq)]
pub struct PageRequest {
    pub size: u32,
    pub after: Option<Cursor>,
}

#[derive(Serialize, Deserialize)]
struct Token {
    /// The list and its filter, e.g. `sandboxes?tag=py&all=true`.
    list: String,
    after: Cursor,
}

/// The page a call asks for of `list` (a name that includes any filter).
pub fn request(list: &str, page_size: u32, page_token: &str) -> Result<PageRequest, Status> {
    let size = match page_size {
        0 => DEFAULT_PAGE_SIZE,
        n if n > MAX_PAGE_SIZE => {
            return Err(Status::invalid_argument(format!(
                "page_size: {n} is over the maximum of {MAX_PAGE_SIZE}"
            )))
        }
        n => n,
    };
    if page_token.is_empty() {
        return Ok(PageRequest { size, after: None });
    }
    let bad = || Status::invalid_argument("page_token: not a token this list gave out");
    let bytes = hex::decode(page_token).map_err(|_| bad())?;
    let token: Token = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    if token.list != list {
        return Err(Status::invalid_argument(
            "page_token: it continues another list or filter",
        ));
    }
    Ok(PageRequest {
        size,
        after: Some(token.after),
    })
}

/// Cut `rows` (fetched with one more than the page size) to the page, and the token for the
/// next page ("" when this is the last).
pub fn finish<T>(
    list: &str,
    req: &PageRequest,
    mut rows: Vec<T>,
    cursor: impl Fn(&T) -> Cursor,
) -> (Vec<T>, String) {
    if rows.len() <= req.size as usize {
        return (rows, String::new());
    }
    rows.truncate(req.size as usize);
    let after = cursor(rows.last().expect("a page of at least one"));
    let token = Token {
        list: list.to_string(),
        after,
    };
    let json = serde_json::to_vec(&token).expect("a token serialises");
    (rows, hex::encode(json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_walk_a_list_and_tokens_stay_with_their_list() {
        let all: Vec<(i64, String)> = (0..7).map(|i| (i / 2, format!("k{i}"))).collect();
        let cursor = |r: &(i64, String)| Cursor {
            created_ms: r.0,
            key: r.1.clone(),
        };
        let mut seen = Vec::new();
        let mut token = String::new();
        loop {
            let req = request("l?x=1", 3, &token).unwrap();
            let rows: Vec<_> = all
                .iter()
                .filter(|r| {
                    req.after
                        .as_ref()
                        .is_none_or(|a| (r.0, &r.1) > (a.created_ms, &a.key))
                })
                .take(req.size as usize + 1)
                .cloned()
                .collect();
            let (page, next) = finish("l?x=1", &req, rows, cursor);
            seen.extend(page);
            if next.is_empty() {
                break;
            }
            token = next;
        }
        assert_eq!(seen, all);
        let req = request("l?x=1", 2, "").unwrap();
        let (_, token) = finish("l?x=1", &req, all.clone(), cursor);
        assert!(request("l?x=2", 2, &token).is_err());
        assert!(request("l?x=1", 2, "zz").is_err());
        assert!(request("l?x=1", 2, "7b7d").is_err());
        assert!(request("l?x=1", MAX_PAGE_SIZE + 1, "").is_err());
        assert_eq!(request("l", 0, "").unwrap().size, DEFAULT_PAGE_SIZE);
    }
}
