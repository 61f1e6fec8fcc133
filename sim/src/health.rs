//! NVML's view of a GPU's health, simulated: temperature, power and the SM
//! clock follow the device's utilisation as a real GPU's do (idle cool and
//! slow, busy warm and at its boost clock), ECC counts none, and XID events
//! come from `GPUFRAC_SIM_XID` (`DEVICE:XID`, comma-separated): each event
//! set registered for a device delivers that XID once, as the driver
//! delivers a critical error.

use std::ffi::c_uint;

use gpufrac_common::cuda::*;

use crate::nvml::{dev, handle};

/// The power a device may draw, mW: an 80 GiB part's 700 W, else 300 W.
fn power_limit(total: u64) -> u32 {
    if total >= 80 << 30 { 700_000 } else { 300_000 }
}

/// `GPUFRAC_SIM_XID`: (device, XID) pairs, read on first use.
fn configured_xids() -> &'static [(usize, u64)] {
    static V: std::sync::OnceLock<Vec<(usize, u64)>> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        std::env::var("GPUFRAC_SIM_XID")
            .unwrap_or_default()
            .split(',')
            .filter_map(|e| {
                let (d, x) = e.trim().split_once(':')?;
                Some((d.parse().ok()?, x.parse().ok()?))
            })
            .collect()
    })
}

/// An event set: the devices registered for XID events, and the XIDs it
/// still has to deliver.
struct EventSet {
    pending: std::sync::Mutex<Vec<(usize, u64)>>,
}

fn set_of(set: nvmlEventSet_t) -> Result<&'static EventSet, nvmlReturn_t> {
    if set.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: made by nvmlEventSetCreate (a leaked box) and not yet freed:
    // the caller's contract.
    Ok(unsafe { &*(set as *const EventSet) })
}

nvml_exports! {
    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensor: c_uint, temp: *mut c_uint) {
        let (s, d) = dev(device)?;
        if sensor != NVML_TEMPERATURE_GPU || temp.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let util = if s.phys[d].mig { 0 } else { s.utilization(d) };
        *temp = 34 + util / 2;
        Ok(())
    }

    fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: *mut c_uint) {
        let (s, d) = dev(device)?;
        if power.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let limit = power_limit(s.phys[d].total);
        let util = if s.phys[d].mig { 0 } else { s.utilization(d) };
        let idle = 60_000;
        *power = idle + (limit - idle) / 100 * util.min(100);
        Ok(())
    }

    fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: *mut c_uint) {
        let (s, d) = dev(device)?;
        if limit.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *limit = power_limit(s.phys[d].total);
        Ok(())
    }

    /// The SM clock: the boost clock while busy, the idle clock while not.
    fn nvmlDeviceGetClockInfo(device: nvmlDevice_t, kind: c_uint, clock: *mut c_uint) {
        let (s, d) = dev(device)?;
        if kind != NVML_CLOCK_SM || clock.is_null() {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let util = if s.phys[d].mig { 0 } else { s.utilization(d) };
        *clock = if util > 0 { 1980 } else { 345 };
        Ok(())
    }

    /// ECC is on and has counted nothing.
    fn nvmlDeviceGetTotalEccErrors(
        device: nvmlDevice_t,
        kind: c_uint,
        counter: c_uint,
        count: *mut u64,
    ) {
        dev(device)?;
        if kind > NVML_MEMORY_ERROR_TYPE_UNCORRECTED || counter > 1 || count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        *count = 0;
        Ok(())
    }

    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) {
        crate::nvml::nvml()?;
        if set.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let b = Box::new(EventSet {
            pending: std::sync::Mutex::new(Vec::new()),
        });
        *set = Box::into_raw(b) as nvmlEventSet_t;
        Ok(())
    }

    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, kinds: u64, set: nvmlEventSet_t) {
        let (_, d) = dev(device)?;
        let set = set_of(set)?;
        if kinds & NVML_EVENT_TYPE_XID_CRITICAL_ERROR != 0 {
            let mut p = set.pending.lock().unwrap_or_else(|e| e.into_inner());
            p.extend(configured_xids().iter().filter(|&&(x, _)| x == d));
        }
        Ok(())
    }

    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, kinds: *mut u64) {
        dev(device)?;
        crate::out(kinds, NVML_EVENT_TYPE_XID_CRITICAL_ERROR, NVML_ERROR_INVALID_ARGUMENT)
    }

    /// The next XID the set has to deliver, else a timeout at once (NVML
    /// may return before the timeout).
    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, _timeout_ms: c_uint) {
        let set = set_of(set)?;
        if data.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let mut p = set.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_empty() {
            return Err(NVML_ERROR_TIMEOUT);
        }
        let (d, xid) = p.remove(0);
        *data = nvmlEventData_t {
            device: handle(d),
            eventType: NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
            eventData: xid,
            gpuInstanceId: u32::MAX,
            computeInstanceId: u32::MAX,
        };
        Ok(())
    }

    fn nvmlEventSetFree(set: nvmlEventSet_t) {
        set_of(set)?;
        // SAFETY: made by nvmlEventSetCreate; freed once, by contract.
        drop(unsafe { Box::from_raw(set as *mut EventSet) });
        Ok(())
    }
}
