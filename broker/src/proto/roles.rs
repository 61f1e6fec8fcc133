//! Which role sends which message. A connection's first `Hello` says what
//! it is, and from then on it may send only its role's messages: a shim
//! registers, joins, reports usage and takes turns at the GPU; a CLI
//! client (`gpufrac run`, `gpufrac status`, the device plugin) asks for
//! status and leases and names its lease. So a connection that said it
//! is one never acts as the other: a `gpufrac status` connection cannot
//! hold a GPU's turn, and a process's shim cannot hold a lease. `Ping`
//! is either's. Which role sends which message is the wire's table
//! (`ClientMsg::sender`); what is said when a connection breaks it is here.

use gpufrac_common::wire::{ClientMsg, Role};

/// `Role::Shim` is 1 on the wire, `Role::Cli` 2: the number a client's
/// author finds in their `Hello`.
fn said(role: Role) -> &'static str {
    match role {
        Role::Shim => "a shim (Hello role 1)",
        Role::Cli => "a CLI client (Hello role 2)",
    }
}

fn owner(role: Role) -> &'static str {
    match role {
        Role::Shim => "a shim's message (libgpufrac.so in a process)",
        Role::Cli => "a CLI client's message (gpufrac run, gpufrac status, the device plugin)",
    }
}

fn named(role: Role) -> &'static str {
    match role {
        Role::Shim => "Shim",
        Role::Cli => "Cli",
    }
}

/// Why `msg`, the message of role `right`, is refused on a connection
/// that said it is `conn`, and what would be right.
pub(super) fn refusal(msg: &ClientMsg, right: Role, conn: Role) -> String {
    format!(
        "{} is {}; this connection said it is {}; open another connection with role {}",
        msg.name(),
        owner(right),
        said(conn),
        named(right)
    )
}

/// Why a second `Hello` naming role `asked` is refused on a connection
/// that said it is `conn`.
pub(super) fn second_hello(asked: Role, conn: Role) -> String {
    format!(
        "Hello with role {} on a connection that said it is {}: a connection keeps the role of \
         its first Hello; open another connection with role {}",
        named(asked),
        said(conn),
        named(asked)
    )
}
