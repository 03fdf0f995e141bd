//! Reading and writing serde configs (JSON, TOML) with errors that name the
//! field: the path comes from `serde_path_to_error`, range checks from
//! [`Validate`].

use crate::error::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::Path;

/// Checks that go beyond types (ranges, combinations).
pub trait Validate {
    /// # Errors
    /// [`Error::Config`] naming the first field that is wrong.
    fn validate(&self) -> Result<()>;
}

fn field_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> Error {
    let path = e.path().to_string();
    Error::Config {
        field: if path == "." {
            "(top level)".into()
        } else {
            path
        },
        reason: e.inner().to_string(),
    }
}

/// Parses and validates JSON.
///
/// # Errors
/// [`Error::Config`] naming the field.
pub fn from_json<T: DeserializeOwned + Validate>(text: &str) -> Result<T> {
    let de = &mut serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(de).map_err(field_error)?;
    value.validate()?;
    Ok(value)
}

/// Parses and validates TOML.
///
/// # Errors
/// [`Error::Config`] naming the field.
pub fn from_toml<T: DeserializeOwned + Validate>(text: &str) -> Result<T> {
    let de = toml::Deserializer::parse(text).map_err(|e| Error::Config {
        field: "(syntax)".into(),
        reason: e.to_string(),
    })?;
    let value: T = serde_path_to_error::deserialize(de).map_err(field_error)?;
    value.validate()?;
    Ok(value)
}

/// Reads a config file, JSON or TOML by its extension.
///
/// # Errors
/// [`Error::ConfigFile`] when unreadable or of another extension,
/// [`Error::Config`] when a field is wrong.
pub fn from_path<T: DeserializeOwned + Validate>(path: &Path) -> Result<T> {
    let file_error = |reason: String| Error::ConfigFile {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
    match path.extension().and_then(|e| e.to_str()) {
        Some("json") => from_json(&text),
        Some("toml") => from_toml(&text),
        _ => Err(file_error("expected a .json or .toml file".into())),
    }
}

/// Pretty JSON.
///
/// # Errors
/// When serde_json fails (not for plain configs).
pub fn to_json<T: Serialize>(value: &T) -> Result<String> {
    serde_json::to_string_pretty(value).map_err(|e| Error::Config {
        field: "(output)".into(),
        reason: e.to_string(),
    })
}

/// TOML.
///
/// # Errors
/// When toml fails (not for plain configs).
pub fn to_toml<T: Serialize>(value: &T) -> Result<String> {
    toml::to_string(value).map_err(|e| Error::Config {
        field: "(output)".into(),
        reason: e.to_string(),
    })
}
