//! GPU admission queue (in progress)
