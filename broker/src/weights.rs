//! Users' weights (`--user-weight`, `--group-weight`): what the broker
//! gives the scheduler as each user's weight, and how the options are
//! read.

use std::collections::BTreeMap;

/// Users' weights, the top level of fairness (`--user-weight`,
/// `--group-weight`): a user with work gets a part of each GPU in
/// proportion to it (1 unless configured).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Weights {
    /// By uid.
    pub users: BTreeMap<u32, f64>,
    /// By gid.
    pub groups: BTreeMap<u32, f64>,
}

impl Weights {
    /// `uid`'s weight: its own if configured, else the largest of its
    /// groups' (`gids`: those its process runs with), else 1.
    pub fn of(&self, uid: u32, gids: &[u32]) -> f64 {
        if let Some(&w) = self.users.get(&uid) {
            return w;
        }
        gids.iter()
            .filter_map(|g| self.groups.get(g).copied())
            .max_by(f64::total_cmp)
            .unwrap_or(1.0)
    }
}

/// Parses one `NAME=WEIGHT` of `--user-weight` or `--group-weight`:
/// `resolve` turns the name (or number) into an id.
pub fn parse_weight(
    flag: &str,
    arg: &str,
    resolve: impl Fn(&str) -> Result<u32, String>,
) -> Result<(u32, f64), String> {
    let example = format!("{flag} alice=2");
    let (name, w) = arg
        .split_once('=')
        .ok_or_else(|| format!("{flag} {arg:?}: expected NAME=WEIGHT, e.g. {example}"))?;
    let id = resolve(name.trim()).map_err(|e| format!("{flag} {arg}: {e}"))?;
    let w: f64 = w.trim().parse().ok().filter(|w: &f64| w.is_finite() && *w > 0.0).ok_or_else(|| {
        format!("{flag} {arg}: the weight must be a number above 0 (1 is the default), e.g. {example}")
    })?;
    Ok((id, w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_options_are_parsed_or_refused_with_an_example() {
        let ids = |n: &str| match n {
            "alice" => Ok(1000),
            n => n.parse().map_err(|_| format!("no such user: {n}")),
        };
        assert_eq!(
            parse_weight("--user-weight", "alice=2", ids),
            Ok((1000, 2.0))
        );
        assert_eq!(parse_weight("--user-weight", "7=0.5", ids), Ok((7, 0.5)));
        for (bad, says) in [
            ("alice", "expected NAME=WEIGHT"),
            ("alice=0", "above 0"),
            ("alice=-1", "above 0"),
            ("alice=NaN", "above 0"),
            ("alice=lots", "above 0"),
            ("bob=2", "no such user: bob"),
        ] {
            let e = parse_weight("--user-weight", bad, ids).unwrap_err();
            assert!(
                e.contains(says) && e.contains("--user-weight"),
                "{bad}: {e}"
            );
        }
        let w = Weights {
            users: [(1000, 2.0)].into(),
            groups: [(50, 3.0), (60, 4.0)].into(),
        };
        assert_eq!(w.of(1000, &[60]), 2.0, "a user's own weight wins");
        assert_eq!(
            w.of(1001, &[50, 60]),
            4.0,
            "else the largest of its groups'"
        );
        assert_eq!(w.of(1002, &[70]), 1.0);
    }
}
