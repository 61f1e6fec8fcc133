//! Compute timeslice scheduler (in progress)
