//! Whether the casts count what they lose: the saturated and flushed
//! elements of each cast ([`CastStats`](crate::CastStats), a
//! [`ScalingMeta`](crate::ScalingMeta)'s `last_cast_stats`). Counting
//! costs a zeroed two-element output per cast (an allocation, a zero fill
//! and a free on CUDA, where the host queues the casts at the driver's
//! pace), so a cast counts only while this thread asked for it
//! ([`set_cast_counts`]) or records precision telemetry
//! ([`set_telemetry`](crate::set_telemetry)); otherwise its metadata has
//! no counts (`last_cast_stats` is `None`). The codes, scales and amaxes
//! are the same either way.

use std::cell::Cell;

thread_local! {
    static ASKED: Cell<bool> = const { Cell::new(false) };
    static BY_TELEMETRY: Cell<bool> = const { Cell::new(false) };
}

/// Turns counting on or off for the casts this thread runs (per thread,
/// as [`set_telemetry`](crate::set_telemetry); off by default).
pub fn set_cast_counts(on: bool) {
    ASKED.with(|c| c.set(on));
}

/// Telemetry's own request (on while it records).
pub(crate) fn set_counts_for_telemetry(on: bool) {
    BY_TELEMETRY.with(|c| c.set(on));
}

/// Whether the casts this thread runs count their saturated and flushed
/// elements: [`set_cast_counts`] or telemetry asked.
pub fn cast_counts() -> bool {
    ASKED.try_with(Cell::get).unwrap_or(false) || BY_TELEMETRY.try_with(Cell::get).unwrap_or(false)
}
