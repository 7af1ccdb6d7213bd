//! YAML reading, one way for every input lbproxy takes (config files, manifests): serde-saphyr
//! with YAML 1.2 booleans only (`n`, `yes` and `off` are strings, as in Kubernetes' own
//! parser), duplicate keys refused.

use serde::de::DeserializeOwned;

pub use serde_saphyr::Error;

fn options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    // One-line errors ("line 23 column 12: ..."), for logs and Events; no source snippet.
    options.with_snippet = false;
    options
}

/// Every document of `text` (a stream separated by `---`).
pub fn documents<T: DeserializeOwned>(text: &str) -> Result<Vec<T>, Error> {
    serde_saphyr::from_multiple_with_options(text, options())
}

/// The single document of `text`.
#[cfg(test)]
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, Error> {
    serde_saphyr::from_str_with_options(text, options())
}

/// The 1-based line an error points at, if it has a location.
pub fn error_line(e: &Error) -> Option<u64> {
    e.location().map(|l| l.line())
}
