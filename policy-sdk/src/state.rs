//! State hand-over with serde types, for [`Policy::export_state`](crate::Policy::export_state)
//! and [`Policy::import_state`](crate::Policy::import_state).
//!
//! A policy keeps what must survive a hot swap or a restart in a serde type and writes
//! ```
//! use syncopate_policy_sdk::{state, Handoff};
//!
//! #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
//! struct Saved { complete: u64 }
//!
//! let bytes = state::save(&Saved { complete: 7 });
//! let handoff = Handoff { from_name: "mine", from_version: "1.0.0", state: &bytes, workers: vec![] };
//! assert_eq!(state::load::<Saved>(&handoff, "mine").unwrap(), Some(Saved { complete: 7 }));
//! // From another policy (or with nothing saved), there is nothing to load:
//! assert_eq!(state::load::<Saved>(&handoff, "other").unwrap(), None);
//! ```
//! The bytes are postcard, which is positional: add fields only at the end of the type, with
//! `#[serde(default)]`, and a newer version of the policy still reads an older one's state.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use crate::abi::Handoff;

/// The bytes to return from `export_state`.
pub fn save<T: serde::Serialize>(value: &T) -> Vec<u8> {
    crate::guest::encode(value)
}

/// The state `handoff` carries, if it comes from a policy named `name` and is not empty.
/// `Err` (which refuses the swap, leaving the old policy in place) if the bytes do not decode.
pub fn load<T: serde::de::DeserializeOwned>(handoff: &Handoff<'_>, name: &str) -> Result<Option<T>, String> {
    if handoff.from_name != name || handoff.state.is_empty() {
        return Ok(None);
    }
    postcard::from_bytes(handoff.state)
        .map(Some)
        .map_err(|e| format!("cannot read the state of `{name}` {}: {e}", handoff.from_version))
}
