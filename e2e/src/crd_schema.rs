//! What a Kubernetes API server does to a custom resource on create and update, from its CRD's
//! structural schema (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/):
//! unknown fields pruned, `default`s filled (also where a non-nullable field is `null`), types and
//! value constraints checked, and the `x-kubernetes-validations` CEL rules run by an embedded CEL
//! interpreter (the `cel` crate) — transition rules (those naming `oldSelf`) only on updates and
//! only where the old object has the value, and errors on a value an update leaves as it was
//! ratcheted away (CRD validation ratcheting, on by default since Kubernetes 1.30). The rules get
//! the Kubernetes `quantity` library (`quantity`, `isQuantity`, `compareTo`, `isLessThan`,
//! `isGreaterThan`, `asApproximateFloat`), exact like the real one.
//!
//! Errors are `field.Error`s in the API server's words (`spec.nodes: Invalid value: "string":
//! spec.nodes in body must be of type integer: "string"`, `spec: Invalid value: "object":
//! MESSAGE`). The schema keywords handled are those [`SUPPORTED`] lists; a CRD using another is
//! refused when it is read ([`SchemaError::Unsupported`]) rather than half-checked.
//!
//! Used by the API-server double (`apiserver`) for every custom resource whose CRD was created
//! in it, and by the tests of the committed CRDs (`tests/e2e/crds.rs`).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use cel::extractors::This;
use cel::objects::{Key as CelKey, Opaque};
use cel::{ExecutionError, Program};
use serde_json::Value;

/// The schema keywords understood (everything dpukv's CRD and the Kubernetes types it embeds use).
pub const SUPPORTED: &[&str] = &[
    "type",
    "description",
    "title",
    "properties",
    "items",
    "additionalProperties",
    "required",
    "default",
    "nullable",
    "format",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "x-kubernetes-int-or-string",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
];

/// A CRD the double cannot hold.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SchemaError {
    /// No served version has an `openAPIV3Schema`.
    #[error("the CustomResourceDefinition serves no version with an openAPIV3Schema")]
    NoSchema,
    /// A keyword outside [`SUPPORTED`].
    #[error("{path}: schema keyword {keyword:?} is not one the double checks")]
    Unsupported {
        /// Where in the schema.
        path: String,
        /// The keyword.
        keyword: String,
    },
    /// A CEL rule that does not compile (the real API server refuses the CRD too).
    #[error("{path}: x-kubernetes-validations rule {rule:?}: compilation failed: {message}")]
    Rule {
        /// Where in the schema.
        path: String,
        /// The rule.
        rule: String,
        /// The compiler's words.
        message: String,
    },
}

/// One thing wrong with an object, as the API server says it (a `field.Error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field (`spec.storage.size`).
    pub path: String,
    /// What (`Required value`, `Invalid value: "object": MESSAGE`).
    pub detail: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.detail)
    }
}

/// The message of a 422 refusing `errors` for the object `name` of `kind.group`, in the API
/// server's form (one error bare, several in brackets).
pub fn invalid_message(kind: &str, group: &str, name: &str, errors: &[FieldError]) -> String {
    let what = if group.is_empty() { kind.to_string() } else { format!("{kind}.{group}") };
    let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
    if list.len() == 1 {
        format!("{what} {name:?} is invalid: {}", list[0])
    } else {
        format!("{what} {name:?} is invalid: [{}]", list.join(", "))
    }
}

/// A rule of a schema and where it applies (property names from the root; `*` for the items of
/// a list or the values of a map).
#[derive(Debug, Clone)]
pub struct RuleAt {
    /// Property names from the root.
    pub path: Vec<String>,
    /// The CEL expression.
    pub rule: String,
    /// Its message (`failed rule: RULE` when the CRD gives none).
    pub message: String,
}

/// A Kubernetes resource quantity (`10Gi`, `500m`, `1.5Ti`, `1e3`), exact, in thousandths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Quantity(i128);

impl Quantity {
    /// Parses the Kubernetes quantity syntax: an optional sign, a decimal number, and a binary
    /// (`Ki`..`Ei`), decimal (`m`, `k`, `M`..`E`) or exponent (`e3`, `E-3`) suffix. Amounts below
    /// a thousandth round up, as the API server's canonical form does.
    pub fn parse(s: &str) -> Option<Quantity> {
        let (negative, rest) = match s.as_bytes().first()? {
            b'-' => (true, &s[1..]),
            b'+' => (false, &s[1..]),
            _ => (false, s),
        };
        let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(end);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() || fraction.contains('.') || number.len() > 30 {
            return None;
        }
        let digits: i128 = format!("{whole}{fraction}").parse().ok()?;
        // value = digits × 10^-scale × multiplier; in thousandths: × 1000.
        let scale = fraction.len() as i32;
        let (mult, exp10): (i128, i32) = match suffix {
            "" => (1, 0),
            "m" => (1, -3),
            "k" => (1, 3),
            "M" => (1, 6),
            "G" => (1, 9),
            "T" => (1, 12),
            "P" => (1, 15),
            "E" => (1, 18),
            "Ki" => (1 << 10, 0),
            "Mi" => (1 << 20, 0),
            "Gi" => (1 << 30, 0),
            "Ti" => (1 << 40, 0),
            "Pi" => (1 << 50, 0),
            "Ei" => (1 << 60, 0),
            e if e.starts_with(['e', 'E']) => (1, e[1..].parse::<i32>().ok().filter(|x| x.abs() <= 18)?),
            _ => return None,
        };
        let exp = exp10 + 3 - scale;
        let base = digits.checked_mul(mult)?;
        let milli = if exp >= 0 {
            base.checked_mul(10i128.checked_pow(exp as u32)?)?
        } else {
            let d = 10i128.checked_pow((-exp) as u32)?;
            (base + d - 1) / d
        };
        Some(Quantity(if negative { -milli } else { milli }))
    }

    /// The amount as a float (`asApproximateFloat`).
    pub fn as_f64(self) -> f64 {
        self.0 as f64 / 1000.0
    }
}

impl Opaque for Quantity {
    fn runtime_type_name(&self) -> &str {
        "kubernetes.Quantity"
    }
}

fn quantity_of(function: &str, v: &cel::Value) -> Result<Quantity, ExecutionError> {
    match v {
        cel::Value::Opaque(o) => o
            .downcast_ref::<Quantity>()
            .copied()
            .ok_or_else(|| ExecutionError::function_error(function, "not a quantity")),
        _ => Err(ExecutionError::function_error(function, "not a quantity")),
    }
}

/// The Kubernetes CEL quantity library, on `ctx` (names no built-in function has: registering
/// them cannot fail).
fn add_quantity_library(ctx: &mut cel::Context<'_, '_>) {
    let _ = ctx.add_function("quantity", |s: Arc<String>| -> Result<cel::Value, ExecutionError> {
        Quantity::parse(&s)
            .map(|q| cel::Value::Opaque(Arc::new(q)))
            .ok_or_else(|| ExecutionError::function_error("quantity", format!("invalid quantity {s:?}")))
    });
    let _ = ctx.add_function("isQuantity", |s: Arc<String>| Quantity::parse(&s).is_some());
    let _ = ctx.add_function("compareTo", |This(a): This<cel::Value>, b: cel::Value| -> Result<i64, ExecutionError> {
        Ok(match quantity_of("compareTo", &a)?.cmp(&quantity_of("compareTo", &b)?) {
            std::cmp::Ordering::Less => -1,
            std::cmp::Ordering::Equal => 0,
            std::cmp::Ordering::Greater => 1,
        })
    });
    let _ =
        ctx.add_function("isLessThan", |This(a): This<cel::Value>, b: cel::Value| -> Result<bool, ExecutionError> {
            Ok(quantity_of("isLessThan", &a)? < quantity_of("isLessThan", &b)?)
        });
    let _ =
        ctx.add_function("isGreaterThan", |This(a): This<cel::Value>, b: cel::Value| -> Result<bool, ExecutionError> {
            Ok(quantity_of("isGreaterThan", &a)? > quantity_of("isGreaterThan", &b)?)
        });
    let _ = ctx.add_function("asApproximateFloat", |This(a): This<cel::Value>| -> Result<f64, ExecutionError> {
        Ok(quantity_of("asApproximateFloat", &a)?.as_f64())
    });
}

/// A JSON value as CEL sees it in a Kubernetes rule: integers are `int`, other numbers
/// `double`, objects maps with string keys.
pub fn cel_value(v: &Value) -> cel::Value {
    match v {
        Value::Null => cel::Value::Null,
        Value::Bool(b) => cel::Value::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => cel::Value::Int(i),
            None => cel::Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => cel::Value::String(Arc::new(s.clone())),
        Value::Array(items) => cel::Value::List(Arc::new(items.iter().map(cel_value).collect())),
        Value::Object(m) => {
            let map: HashMap<CelKey, cel::Value> =
                m.iter().map(|(k, v)| (CelKey::String(Arc::new(k.clone())), cel_value(v))).collect();
            cel::Value::from(map)
        }
    }
}

/// A custom resource's schema, read from its CRD.
#[derive(Debug, Clone)]
pub struct CrdSchema {
    group: String,
    kind: String,
    plural: String,
    root: Value,
}

/// The `type` name the API server prints for a value of schema `s`.
fn type_name(s: &Value) -> &str {
    if s["x-kubernetes-int-or-string"] == true {
        return "integer,string";
    }
    s["type"].as_str().unwrap_or("object")
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn fits(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        _ => true,
    }
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() { name.to_string() } else { format!("{path}.{name}") }
}

/// A value as the API server quotes it in `Invalid value: ...`.
fn quoted(v: &Value) -> String {
    match v {
        Value::Object(_) => "\"object\"".into(),
        Value::Array(_) => "\"array\"".into(),
        other => other.to_string(),
    }
}

impl CrdSchema {
    /// The schema of the CRD's storage version (else its first served one), checked: every
    /// keyword supported and every rule compiling.
    pub fn from_crd(crd: &Value) -> Result<CrdSchema, SchemaError> {
        let versions = crd["spec"]["versions"].as_array().cloned().unwrap_or_default();
        let version = versions
            .iter()
            .find(|v| v["storage"] == true)
            .or_else(|| versions.iter().find(|v| v["served"] == true))
            .ok_or(SchemaError::NoSchema)?;
        let root = version["schema"]["openAPIV3Schema"].clone();
        if !root.is_object() {
            return Err(SchemaError::NoSchema);
        }
        check_schema(&root, "openAPIV3Schema")?;
        Ok(CrdSchema {
            group: crd["spec"]["group"].as_str().unwrap_or_default().to_string(),
            kind: crd["spec"]["names"]["kind"].as_str().unwrap_or_default().to_string(),
            plural: crd["spec"]["names"]["plural"].as_str().unwrap_or_default().to_string(),
            root,
        })
    }

    /// The resource's group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The resource's kind.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The resource's plural.
    pub fn plural(&self) -> &str {
        &self.plural
    }

    /// Every CEL rule of the schema and where it applies.
    pub fn rules(&self) -> Vec<RuleAt> {
        let mut out = Vec::new();
        collect_rules(&self.root, Vec::new(), &mut out);
        out
    }

    /// What the API server does to an object written (`old`: the live one, on an update):
    /// prunes unknown fields, fills defaults, then validates; the errors when it refuses.
    pub fn admit(&self, obj: &mut Value, old: Option<&Value>) -> Result<(), Vec<FieldError>> {
        self.prune(obj);
        self.fill_defaults(obj);
        let errors = self.validate(obj, old);
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }

    /// Drops the fields the schema does not declare (but `apiVersion`, `kind`, `metadata`).
    pub fn prune(&self, obj: &mut Value) {
        prune(&self.root, obj, true);
    }

    /// Fills the schema's defaults where a field is absent (or `null` and not nullable).
    pub fn fill_defaults(&self, obj: &mut Value) {
        fill_defaults(&self.root, obj);
    }

    /// What is wrong with `obj` (an update of `old` when given); nothing when it is valid.
    pub fn validate(&self, obj: &Value, old: Option<&Value>) -> Vec<FieldError> {
        let mut out = Vec::new();
        // The root's metadata is the API server's (ObjectMeta), not the schema's.
        let strip = |v: &Value| {
            let mut v = v.clone();
            if let Some(m) = v.as_object_mut() {
                for k in ["apiVersion", "kind", "metadata"] {
                    m.remove(k);
                }
            }
            v
        };
        let old = old.map(strip);
        check(&self.root, &strip(obj), old.as_ref(), "", &mut out);
        out
    }
}

fn check_schema(s: &Value, path: &str) -> Result<(), SchemaError> {
    let Some(m) = s.as_object() else { return Ok(()) };
    for k in m.keys() {
        if !SUPPORTED.contains(&k.as_str()) {
            return Err(SchemaError::Unsupported { path: path.into(), keyword: k.clone() });
        }
    }
    for r in m.get("x-kubernetes-validations").and_then(Value::as_array).into_iter().flatten() {
        let rule = r["rule"].as_str().unwrap_or_default();
        if let Err(e) = Program::compile(rule) {
            return Err(SchemaError::Rule { path: path.into(), rule: rule.into(), message: e.to_string() });
        }
    }
    for (name, sub) in m.get("properties").and_then(Value::as_object).into_iter().flatten() {
        check_schema(sub, &format!("{path}.properties.{name}"))?;
    }
    if let Some(items) = m.get("items") {
        check_schema(items, &format!("{path}.items"))?;
    }
    if let Some(ap) = m.get("additionalProperties").filter(|a| a.is_object()) {
        check_schema(ap, &format!("{path}.additionalProperties"))?;
    }
    Ok(())
}

fn collect_rules(s: &Value, path: Vec<String>, out: &mut Vec<RuleAt>) {
    for v in s.get("x-kubernetes-validations").and_then(Value::as_array).into_iter().flatten() {
        let rule = v["rule"].as_str().unwrap_or_default().to_string();
        let message = v["message"].as_str().map(String::from).unwrap_or_else(|| format!("failed rule: {rule}"));
        out.push(RuleAt { path: path.clone(), rule, message });
    }
    for (name, sub) in s.get("properties").and_then(Value::as_object).into_iter().flatten() {
        let mut p = path.clone();
        p.push(name.clone());
        collect_rules(sub, p, out);
    }
    for sub in [s.get("items"), s.get("additionalProperties").filter(|a| a.is_object())].into_iter().flatten() {
        let mut p = path.clone();
        p.push("*".into());
        collect_rules(sub, p, out);
    }
}

fn prune(s: &Value, v: &mut Value, root: bool) {
    match v {
        Value::Object(m) => {
            if let Some(props) = s.get("properties").and_then(Value::as_object) {
                m.retain(|k, _| {
                    props.contains_key(k) || (root && matches!(k.as_str(), "apiVersion" | "kind" | "metadata"))
                });
                for (k, sub) in m.iter_mut() {
                    if let Some(ps) = props.get(k) {
                        prune(ps, sub, false);
                    }
                }
            } else if let Some(ap) = s.get("additionalProperties") {
                if ap.is_object() {
                    for sub in m.values_mut() {
                        prune(ap, sub, false);
                    }
                }
            } else if s["type"] == "object" && !root {
                // A structural object schema with no properties holds none.
                m.clear();
            }
        }
        Value::Array(items) => {
            if let Some(is) = s.get("items") {
                for it in items {
                    prune(is, it, false);
                }
            }
        }
        _ => {}
    }
}

fn fill_defaults(s: &Value, v: &mut Value) {
    match v {
        Value::Object(m) => {
            if let Some(props) = s.get("properties").and_then(Value::as_object) {
                for (k, ps) in props {
                    let nullable = ps["nullable"] == true;
                    match m.get(k) {
                        None => {
                            if let Some(d) = ps.get("default") {
                                m.insert(k.clone(), d.clone());
                            }
                        }
                        Some(Value::Null) if !nullable => match ps.get("default") {
                            Some(d) => {
                                m.insert(k.clone(), d.clone());
                            }
                            None => {
                                m.remove(k);
                            }
                        },
                        _ => {}
                    }
                }
                for (k, sub) in m.iter_mut() {
                    if let Some(ps) = props.get(k) {
                        fill_defaults(ps, sub);
                    }
                }
            } else if let Some(ap) = s.get("additionalProperties").filter(|a| a.is_object()) {
                for sub in m.values_mut() {
                    fill_defaults(ap, sub);
                }
            }
        }
        Value::Array(items) => {
            if let Some(is) = s.get("items") {
                for it in items {
                    fill_defaults(is, it);
                }
            }
        }
        _ => {}
    }
}

fn check(s: &Value, v: &Value, old: Option<&Value>, path: &str, out: &mut Vec<FieldError>) {
    // Ratcheting: a value an update leaves as it was is not refused again.
    if old == Some(v) {
        return;
    }
    let here = if path.is_empty() { "<root>" } else { path };
    let push = |out: &mut Vec<FieldError>, detail: String| out.push(FieldError { path: here.into(), detail });
    if v.is_null() {
        if s["nullable"] != true && s.get("type").is_some() {
            push(out, format!("Invalid value: \"null\": {here} in body must be of type {}: \"null\"", type_name(s)));
        }
        return;
    }
    let before = out.len();
    if s["x-kubernetes-int-or-string"] == true {
        if !(v.is_i64() || v.is_u64() || v.is_string()) {
            push(
                out,
                format!(
                    "Invalid value: {}: {here} in body must be of type integer,string: {:?}",
                    quoted(v),
                    json_type(v)
                ),
            );
            return;
        }
    } else if let Some(t) = s["type"].as_str()
        && !fits(t, v)
    {
        push(
            out,
            format!("Invalid value: \"{}\": {here} in body must be of type {t}: \"{}\"", json_type(v), json_type(v)),
        );
        return;
    }
    if let Some(allowed) = s["enum"].as_array()
        && !allowed.contains(v)
    {
        let list: Vec<String> = allowed.iter().map(ToString::to_string).collect();
        push(out, format!("Unsupported value: {v}: supported values: {}", list.join(", ")));
    }
    if let Some(x) = v.as_f64() {
        if let Some(min) = s["minimum"].as_f64() {
            let exclusive = s["exclusiveMinimum"] == true;
            if x < min || (exclusive && x == min) {
                let how = if exclusive { "greater than" } else { "greater than or equal to" };
                push(out, format!("Invalid value: {v}: {here} in body should be {how} {}", s["minimum"]));
            }
        }
        if let Some(max) = s["maximum"].as_f64() {
            let exclusive = s["exclusiveMaximum"] == true;
            if x > max || (exclusive && x == max) {
                let how = if exclusive { "less than" } else { "less than or equal to" };
                push(out, format!("Invalid value: {v}: {here} in body should be {how} {}", s["maximum"]));
            }
        }
    }
    if let Some(text) = v.as_str() {
        let n = text.chars().count() as u64;
        if s["minLength"].as_u64().is_some_and(|m| n < m) {
            push(out, format!("Invalid value: {v}: {here} in body should be at least {} chars long", s["minLength"]));
        }
        if s["maxLength"].as_u64().is_some_and(|m| n > m) {
            push(out, format!("Too long: may not be more than {} bytes", s["maxLength"]));
        }
    }
    if let Some(items) = v.as_array() {
        let n = items.len() as u64;
        if s["minItems"].as_u64().is_some_and(|m| n < m) {
            push(out, format!("Invalid value: {n}: {here} in body should have at least {} items", s["minItems"]));
        }
        if s["maxItems"].as_u64().is_some_and(|m| n > m) {
            push(out, format!("Too many: {n}: must have at most {} items", s["maxItems"]));
        }
        if let Some(is) = s.get("items") {
            for (i, it) in items.iter().enumerate() {
                // Items of a list are not correlated with the old list's (an atomic list).
                check(is, it, None, &format!("{path}[{i}]"), out);
            }
        }
    }
    if let Some(m) = v.as_object() {
        let n = m.len() as u64;
        if s["minProperties"].as_u64().is_some_and(|x| n < x) {
            push(
                out,
                format!("Invalid value: {n}: {here} in body should have at least {} properties", s["minProperties"]),
            );
        }
        if s["maxProperties"].as_u64().is_some_and(|x| n > x) {
            push(out, format!("Too many: {n}: must have at most {} items", s["maxProperties"]));
        }
        for r in s["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !m.contains_key(r) {
                out.push(FieldError { path: join(path, r), detail: "Required value".into() });
            }
        }
        let old_field = |k: &str| old.and_then(|o| o.get(k));
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            for (k, sub) in m {
                if let Some(ps) = props.get(k) {
                    check(ps, sub, old_field(k), &join(path, k), out);
                }
            }
        } else if let Some(ap) = s.get("additionalProperties").filter(|a| a.is_object()) {
            for (k, sub) in m {
                check(ap, sub, old_field(k), &format!("{path}[{k}]"), out);
            }
        }
    }
    // The rules run on values the schema accepts.
    if out.len() == before {
        run_rules(s, v, old, path, out);
    }
}

fn run_rules(s: &Value, v: &Value, old: Option<&Value>, path: &str, out: &mut Vec<FieldError>) {
    let here = if path.is_empty() { "<root>" } else { path };
    for r in s.get("x-kubernetes-validations").and_then(Value::as_array).into_iter().flatten() {
        let rule = r["rule"].as_str().unwrap_or_default();
        let Ok(program) = Program::compile(rule) else { continue };
        let transition = program.references().has_variable("oldSelf");
        let old = old.filter(|o| !o.is_null());
        if transition && old.is_none() {
            continue;
        }
        let mut ctx = cel::Context::default();
        add_quantity_library(&mut ctx);
        ctx.add_variable_from_value("self", cel_value(v));
        if let Some(o) = old {
            ctx.add_variable_from_value("oldSelf", cel_value(o));
        }
        let message = r["message"].as_str().map(String::from).unwrap_or_else(|| format!("failed rule: {rule}"));
        let field = match r["fieldPath"].as_str() {
            Some(fp) => format!("{}{fp}", if path.is_empty() { "" } else { path }),
            None => here.to_string(),
        };
        let detail = match program.execute(&ctx) {
            Ok(cel::Value::Bool(true)) => continue,
            Ok(cel::Value::Bool(false)) => format!("Invalid value: \"{}\": {message}", type_name(s)),
            Ok(other) => format!("Invalid value: \"{}\": rule {rule:?} gave {other:?}, not a bool", type_name(s)),
            Err(e) => format!("Invalid value: \"{}\": rule {rule:?}: evaluation error: {e}", type_name(s)),
        };
        out.push(FieldError { path: field, detail });
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn crd(schema: Value) -> Value {
        json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
               "metadata": {"name": "things.example.com"},
               "spec": {"group": "example.com", "names": {"kind": "Thing", "plural": "things"}, "scope": "Namespaced",
                        "versions": [{"name": "v1", "served": true, "storage": true,
                                      "schema": {"openAPIV3Schema": schema}}]}})
    }

    fn thing() -> CrdSchema {
        CrdSchema::from_crd(&crd(json!({
            "type": "object", "required": ["spec"],
            "properties": {"spec": {
                "type": "object", "required": ["size"],
                "x-kubernetes-validations": [
                    {"rule": "self.low <= self.high", "message": "low must not exceed high"},
                    {"rule": "quantity(self.size).compareTo(quantity(oldSelf.size)) >= 0", "message": "size cannot shrink"}],
                "properties": {
                    "size": {"type": "string"},
                    "low": {"type": "integer", "default": 1, "minimum": 0},
                    "high": {"type": "integer", "default": 10, "maximum": 100},
                    "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "note": {"type": "string", "nullable": true}}}}})))
        .expect("the CRD")
    }

    /// The errors as the API server prints them, sorted.
    fn paths(e: &[FieldError]) -> Vec<String> {
        let mut out: Vec<String> = e.iter().map(ToString::to_string).collect();
        out.sort();
        out
    }

    #[test]
    fn quantities_parse_exactly() {
        let q = |s: &str| Quantity::parse(s).map(|q| q.0);
        assert_eq!(q("1"), Some(1000));
        assert_eq!(q("10Gi"), Some(10 * (1 << 30) * 1000));
        assert_eq!(q("1.5Ti"), Some(3 * (1 << 39) * 1000));
        assert_eq!(q("500M"), Some(500_000_000_000));
        assert_eq!(q("250m"), Some(250));
        assert_eq!(q("1e3"), Some(1_000_000));
        assert_eq!(q("-2k"), Some(-2_000_000));
        assert_eq!(q("0.0001"), Some(1), "below a thousandth rounds up");
        assert!(Quantity::parse("2Gi") > Quantity::parse("2G"));
        for bad in ["", "ten", "10GB", "1..2", "Gi", "1.2.3"] {
            assert_eq!(q(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn defaults_are_filled_and_unknown_fields_pruned() {
        let s = thing();
        let mut o = json!({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
                           "spec": {"size": "1Gi", "bogus": 1, "note": null, "labels": {"a": "b"}}, "extra": true});
        s.admit(&mut o, None).expect("valid");
        assert_eq!(
            o,
            json!({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"},
                   "spec": {"size": "1Gi", "low": 1, "high": 10, "mode": "a", "note": null, "labels": {"a": "b"}}})
        );
    }

    #[test]
    fn types_constraints_and_rules_are_refused_in_the_api_server_s_words() {
        let s = thing();
        let mut o = json!({"spec": {"size": "1Gi", "low": "x", "high": 200, "mode": "c", "labels": {"a": 1}}});
        let e = s.admit(&mut o, None).expect_err("invalid");
        assert_eq!(
            paths(&e),
            [
                "spec.high: Invalid value: 200: spec.high in body should be less than or equal to 100",
                "spec.labels[a]: Invalid value: \"integer\": spec.labels[a] in body must be of type string: \"integer\"",
                "spec.low: Invalid value: \"string\": spec.low in body must be of type integer: \"string\"",
                "spec.mode: Unsupported value: \"c\": supported values: \"a\", \"b\"",
            ]
        );
        let e = s.admit(&mut json!({"spec": {"low": 5, "high": 4}}), None).expect_err("invalid");
        assert_eq!(paths(&e), ["spec.size: Required value"]);
        let e = s.admit(&mut json!({"spec": {"size": "1", "low": 5, "high": 4}}), None).expect_err("invalid");
        assert_eq!(paths(&e), ["spec: Invalid value: \"object\": low must not exceed high"]);
        assert_eq!(
            invalid_message("Thing", "example.com", "t", &e),
            "Thing.example.com \"t\" is invalid: spec: Invalid value: \"object\": low must not exceed high"
        );
    }

    #[test]
    fn transition_rules_run_on_updates_only_and_unchanged_values_ratchet() {
        let s = thing();
        let old = json!({"spec": {"size": "2Gi", "low": 1, "high": 10, "mode": "a"}});
        let mut smaller = json!({"spec": {"size": "1Gi"}});
        assert!(s.admit(&mut smaller.clone(), None).is_ok(), "on create the transition rule does not run");
        let e = s.admit(&mut smaller, Some(&old)).expect_err("a shrink");
        assert_eq!(paths(&e), ["spec: Invalid value: \"object\": size cannot shrink"]);
        assert!(s.admit(&mut json!({"spec": {"size": "2049Mi"}}), Some(&old)).is_ok(), "a growth");
        // An invalid value stored before a rule existed does not block other updates...
        let stored = json!({"spec": {"size": "1Gi", "labels": {"a": 1}}, "status": {"x": 1}});
        assert!(s.validate(&stored, Some(&stored)).is_empty());
        // ...but a change that keeps it is refused for the value it changed only.
        let mut changed = json!({"spec": {"size": "1Gi", "labels": {"a": 1, "b": 2}}});
        let e = s.admit(&mut changed, Some(&stored)).expect_err("the new label");
        assert_eq!(
            paths(&e),
            ["spec.labels[b]: Invalid value: \"integer\": spec.labels[b] in body must be of type string: \"integer\""]
        );
    }

    #[test]
    fn quantity_values_compare_only_as_quantities() {
        let mut ctx = cel::Context::default();
        add_quantity_library(&mut ctx);
        let run = |e: &str| Program::compile(e).expect("compiles").execute(&ctx);
        assert_eq!(run("quantity('1Gi').isGreaterThan(quantity('1G'))").ok(), Some(cel::Value::Bool(true)));
        assert_eq!(run("quantity('1k').compareTo(quantity('1000'))").ok(), Some(cel::Value::Int(0)));
        assert_eq!(run("isQuantity('10GB')").ok(), Some(cel::Value::Bool(false)));
        assert!(run("quantity('1') < quantity('2')").is_err(), "no ordering operator on quantities");
        assert!(run("quantity('x')").is_err());
    }

    #[test]
    fn a_crd_with_a_keyword_the_double_does_not_check_or_a_bad_rule_is_refused() {
        let e = CrdSchema::from_crd(&crd(
            json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x$"}}}),
        ))
        .expect_err("pattern");
        assert!(matches!(e, SchemaError::Unsupported { ref keyword, .. } if keyword == "pattern"), "{e}");
        let e =
            CrdSchema::from_crd(&crd(json!({"type": "object", "x-kubernetes-validations": [{"rule": "self.a <"}]})))
                .expect_err("rule");
        assert!(matches!(e, SchemaError::Rule { .. }), "{e}");
    }
}
