//! The one error a configuration can have: the file (or `flag`), the field, and why.

/// A refused setting: where it came from, which field, and why.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {origin}: {field}: {reason}")]
pub struct ConfigError {
    pub origin: String,
    pub field: String,
    pub reason: String,
}

pub(crate) fn err(origin: &str, field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        origin: origin.to_string(),
        field: field.to_string(),
        reason: reason.into(),
    }
}
