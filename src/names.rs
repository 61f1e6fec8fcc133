//! User names for the uids the broker sends, from this node's user
//! database (NSS: /etc/passwd, LDAP, ...). Looked up here, by the command
//! showing them, rather than in the broker: a directory service may take
//! seconds to answer, and the broker's event loop must not wait for one.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::Mutex;

/// Names already looked up (a uid without one is kept as its number):
/// `gpufrac top` shows the same few users every second.
static CACHE: Mutex<Option<HashMap<u32, String>>> = Mutex::new(None);

/// The user's name, or the uid as a number when the database has none.
pub fn user(uid: u32) -> String {
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    cache
        .get_or_insert_with(HashMap::new)
        .entry(uid)
        .or_insert_with(|| look_up(uid).unwrap_or_else(|| uid.to_string()))
        .clone()
}

/// The uid of whoever runs this command.
pub fn me() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

fn look_up(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: zeroed passwd is a valid out-parameter; buf outlives the
        // call and the pointers into it are read before it is dropped.
        let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::passwd = std::ptr::null_mut();
        let rc =
            unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out) };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if rc != 0 || out.is_null() || pw.pw_name.is_null() {
            return None;
        }
        // SAFETY: getpwuid_r succeeded, so pw_name points at a NUL-ended
        // string inside buf.
        let name = unsafe { CStr::from_ptr(pw.pw_name) };
        let name = name.to_string_lossy();
        // A name is shown in tables: nothing that would move the cursor,
        // reorder a line or hide in it (then its number is shown).
        return (!name.is_empty() && !name.chars().any(gpufrac_common::text::is_hidden))
            .then(|| name.into_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_has_a_name_and_an_unknown_uid_is_a_number() {
        assert_eq!(user(0), "root");
        assert_eq!(user(4_000_000_123), "4000000123");
        // From the cache the second time, the same.
        assert_eq!(user(0), "root");
    }
}
