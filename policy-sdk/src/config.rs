//! Policy configuration: validated against the policy's declared parameters before it is created.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;
use core::str::FromStr;

use crate::abi::{ParamKind, ParamSpec};

/// A policy's configuration, checked against its [`ParamSpec`]s: every parameter has a value
/// (given or default) of the declared kind, and no unknown name was given.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    values: Vec<(String, String)>,
}

/// A configuration that does not fit the policy's parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Config {
    /// Checks `given` against `params`, filling in defaults.
    pub fn validate(params: &[ParamSpec], given: &[(&str, &str)]) -> Result<Self, ConfigError> {
        for (name, _) in given {
            if !params.iter().any(|p| p.name == *name) {
                let known: Vec<&str> = params.iter().map(|p| p.name).collect();
                return Err(ConfigError(if known.is_empty() {
                    format!("unknown parameter `{name}`: this policy takes no parameters")
                } else {
                    format!("unknown parameter `{name}` (known: {})", known.join(", "))
                }));
            }
        }
        let mut values = Vec::with_capacity(params.len());
        for p in params {
            let value = given.iter().rev().find(|(n, _)| *n == p.name).map(|(_, v)| *v).unwrap_or(p.default);
            check_kind(p, value)?;
            values.push((p.name.to_string(), value.to_string()));
        }
        Ok(Config { values })
    }

    /// The raw text of parameter `name`, if the policy declares it.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// Parameter `name` parsed as `T`.
    ///
    /// # Errors
    /// When the policy does not declare `name` or its value does not parse as `T`.
    pub fn get<T: FromStr>(&self, name: &str) -> Result<T, ConfigError> {
        let text = self
            .text(name)
            .ok_or_else(|| ConfigError(format!("parameter `{name}` is not declared by this policy")))?;
        text.parse().map_err(|_| ConfigError(format!("parameter `{name}`: cannot parse `{text}`")))
    }

    /// Local steps per round from parameter `name`: at least 1 and at most
    /// [`MAX_LOCAL_STEPS`](crate::rules::MAX_LOCAL_STEPS) (local-SGD rules' `h`).
    ///
    /// # Errors
    /// When it does not parse, or is out of bounds; the message names the parameter.
    pub fn local_steps(&self, name: &str) -> Result<u32, ConfigError> {
        let h: u32 = self.get(name)?;
        if h == 0 {
            return Err(ConfigError(format!("{name}: take at least 1 local step")));
        }
        crate::rules::check_local_steps(h).map_err(|e| ConfigError(format!("{name}: {e}")))?;
        Ok(h)
    }

    /// The outer optimizer's learning rate and momentum from parameters `outer_lr` and
    /// `outer_momentum`, within [`check_outer_optimizer`](crate::rules::check_outer_optimizer)'s
    /// bounds.
    ///
    /// # Errors
    /// When either does not parse, or they are out of bounds.
    pub fn outer_optimizer(&self) -> Result<(f32, f32), ConfigError> {
        let (lr, momentum): (f32, f32) = (self.get("outer_lr")?, self.get("outer_momentum")?);
        crate::rules::check_outer_optimizer(lr, momentum).map_err(ConfigError)?;
        Ok((lr, momentum))
    }

    /// All parameters with their values, in declaration order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.values.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

fn check_kind(p: &ParamSpec, value: &str) -> Result<(), ConfigError> {
    let ok = match p.kind {
        ParamKind::Uint => value.parse::<u64>().is_ok(),
        ParamKind::Float => is_finite_decimal(value),
        ParamKind::Bool => value.parse::<bool>().is_ok(),
        ParamKind::Text => true,
    };
    if ok {
        Ok(())
    } else {
        Err(ConfigError(format!("parameter `{}` must be a {}, got `{value}`", p.name, p.kind.name())))
    }
}

/// Whether `text` is a decimal number that `f64::from_str` parses to a finite value below 1e308
/// in magnitude: `[+-]digits[.digits][(e|E)[+-]digits]` with at least one mantissa digit.
///
/// Checked by hand rather than by parsing: this is in every module, and the standard float parser
/// with its tables is about a quarter of a small module. Policies that read a float call
/// [`Config::get`], which parses it exactly.
fn is_finite_decimal(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let digits = |i: &mut usize| {
        let start = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        &b[start..*i]
    };
    let whole = digits(&mut i);
    let frac = if b.get(i) == Some(&b'.') {
        i += 1;
        digits(&mut i)
    } else {
        &[]
    };
    if whole.is_empty() && frac.is_empty() {
        return false;
    }
    let mut exp: i64 = 0;
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        let negative = b.get(i) == Some(&b'-');
        i += usize::from(matches!(b.get(i), Some(b'+' | b'-')));
        let e = digits(&mut i);
        if e.is_empty() {
            return false;
        }
        // Saturate: only whether the magnitude reaches 1e308 matters.
        exp = e.iter().fold(0i64, |acc, d| (acc * 10 + i64::from(d - b'0')).min(1_000_000));
        if negative {
            exp = -exp;
        }
    }
    if i != b.len() {
        return false;
    }
    // The value is below 10^(significant whole digits + exp); zero is always fine.
    let significant = whole.iter().skip_while(|d| **d == b'0').count() as i64;
    let nonzero = whole.iter().chain(frac).any(|d| *d != b'0');
    !nonzero || significant + exp <= 308
}

#[cfg(test)]
mod tests {
    use super::*;
    const PARAMS: &[ParamSpec] = &[ParamSpec::new("s", ParamKind::Uint, "3", "bound")];

    #[test]
    fn defaults_and_overrides() {
        let c = Config::validate(PARAMS, &[]).unwrap();
        assert_eq!(c.get::<u64>("s").unwrap(), 3);
        let c = Config::validate(PARAMS, &[("s", "0")]).unwrap();
        assert_eq!(c.get::<u64>("s").unwrap(), 0);
    }

    #[test]
    fn rejects_unknown_and_mistyped() {
        let e = Config::validate(PARAMS, &[("x", "1")]).unwrap_err();
        assert!(e.0.contains("unknown parameter `x`"), "{e}");
        let e = Config::validate(PARAMS, &[("s", "-1")]).unwrap_err();
        assert!(e.0.contains("must be a uint"), "{e}");
    }

    #[test]
    fn floats_are_checked_as_the_standard_parser_reads_them() {
        for ok in ["0", "1", "-1.5", "+.5", "5.", "1e3", "2.5E-3", "0.000", "9.9e307", "0e999999"] {
            assert!(is_finite_decimal(ok), "{ok}");
            assert!(ok.parse::<f64>().is_ok_and(f64::is_finite), "{ok}");
        }
        for bad in [
            "", ".", "-", "e3", "1e", "1e+", "1.2.3", "inf", "NaN", "1e308", "1e309", "99e307", "0x10", " 1",
            "1 ",
        ] {
            assert!(!is_finite_decimal(bad), "{bad}");
        }
    }
}
