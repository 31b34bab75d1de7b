//! Avro schema resolution, for the schema registry's compatibility checks (Pulsar's Avro and
//! JSON schemas are Avro definitions). Sans-IO.
//!
//! `can_read(reader, writer)` says whether data written with `writer` can be read with
//! `reader` under Avro's resolution rules: same primitive or a promotion (int to long, float
//! or double; long to float or double; float to double; string and bytes both ways); records
//! by field name, where a reader field the writer lacks needs a default and writer fields the
//! reader lacks are skipped; enums when the reader knows every writer symbol (or has a
//! default); arrays and maps by their items; unions branch by branch; fixed of the same size.
//! Record names are not compared (clients name records after their classes, which change).

use std::collections::{HashMap, HashSet};

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub enum Avro {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Bytes,
    String,
    Record {
        name: String,
        fields: Vec<Field>,
    },
    Enum {
        name: String,
        symbols: Vec<String>,
        has_default: bool,
    },
    Array(Box<Avro>),
    Map(Box<Avro>),
    Union(Vec<Avro>),
    Fixed {
        name: String,
        size: u64,
    },
    /// A use of a named type defined elsewhere in the schema (resolved through [`Schema`]).
    Ref(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    pub name: String,
    pub ty: Avro,
    pub has_default: bool,
}

/// A parsed schema with its named types.
#[derive(Debug, Clone)]
pub struct Schema {
    pub root: Avro,
    named: HashMap<String, Avro>,
}

/// Parses an Avro schema definition (JSON text).
pub fn parse(text: &[u8]) -> Result<Schema, String> {
    let v: Value = serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
    let mut named = HashMap::new();
    let root = parse_value(&v, &mut named, 0)?;
    let schema = Schema { root, named };
    schema.check_names(&schema.root)?;
    Ok(schema)
}

const DEPTH_MAX: usize = 64;

fn parse_value(v: &Value, named: &mut HashMap<String, Avro>, depth: usize) -> Result<Avro, String> {
    if depth > DEPTH_MAX {
        return Err("schema nested too deeply".into());
    }
    match v {
        Value::String(s) => Ok(primitive(s).unwrap_or_else(|| Avro::Ref(s.clone()))),
        Value::Array(branches) => Ok(Avro::Union(
            branches
                .iter()
                .map(|b| parse_value(b, named, depth + 1))
                .collect::<Result<_, _>>()?,
        )),
        Value::Object(o) => {
            let ty = o.get("type").ok_or("a schema object without \"type\"")?;
            let name = o
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let kind = match ty {
                Value::String(s) => s.as_str(),
                // {"type": {...}} or {"type": [...]}: the inner schema.
                other => return parse_value(other, named, depth + 1),
            };
            let t = match kind {
                "record" | "error" => {
                    // Registered before its fields, so fields may refer to it (recursion).
                    named.insert(name.clone(), Avro::Ref(name.clone()));
                    let fields = o
                        .get("fields")
                        .and_then(Value::as_array)
                        .ok_or_else(|| format!("record {name} without \"fields\""))?
                        .iter()
                        .map(|f| {
                            let fname = f
                                .get("name")
                                .and_then(Value::as_str)
                                .ok_or_else(|| format!("a field of {name} without a name"))?;
                            let fty = f
                                .get("type")
                                .ok_or_else(|| format!("field {name}.{fname} without a type"))?;
                            Ok(Field {
                                name: fname.to_string(),
                                ty: parse_value(fty, named, depth + 1)?,
                                has_default: f.get("default").is_some(),
                            })
                        })
                        .collect::<Result<Vec<_>, String>>()?;
                    // Avro's names are unique within a record (a reader matches fields by name).
                    let mut seen = std::collections::HashSet::new();
                    if let Some(f) = fields.iter().find(|f| !seen.insert(f.name.as_str())) {
                        return Err(format!("record {name} has two fields named {}", f.name));
                    }
                    Avro::Record {
                        name: name.clone(),
                        fields,
                    }
                }
                "enum" => Avro::Enum {
                    name: name.clone(),
                    symbols: o
                        .get("symbols")
                        .and_then(Value::as_array)
                        .ok_or_else(|| format!("enum {name} without \"symbols\""))?
                        .iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect(),
                    has_default: o.get("default").is_some(),
                },
                "array" => Avro::Array(Box::new(parse_value(
                    o.get("items").ok_or("an array without \"items\"")?,
                    named,
                    depth + 1,
                )?)),
                "map" => Avro::Map(Box::new(parse_value(
                    o.get("values").ok_or("a map without \"values\"")?,
                    named,
                    depth + 1,
                )?)),
                "fixed" => Avro::Fixed {
                    name: name.clone(),
                    size: o
                        .get("size")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| format!("fixed {name} without \"size\""))?,
                },
                // Logical types and other annotations ride on their underlying type.
                other => primitive(other).unwrap_or_else(|| Avro::Ref(other.to_string())),
            };
            if matches!(
                t,
                Avro::Record { .. } | Avro::Enum { .. } | Avro::Fixed { .. }
            ) {
                named.insert(name, t.clone());
            }
            Ok(t)
        }
        other => Err(format!("unexpected {other} in a schema")),
    }
}

fn primitive(s: &str) -> Option<Avro> {
    Some(match s {
        "null" => Avro::Null,
        "boolean" => Avro::Boolean,
        "int" => Avro::Int,
        "long" => Avro::Long,
        "float" => Avro::Float,
        "double" => Avro::Double,
        "bytes" => Avro::Bytes,
        "string" => Avro::String,
        _ => return None,
    })
}

impl Schema {
    /// Every use of a named type names one the schema defines (a schema using an unknown
    /// type was accepted before, and then could not even read its own data).
    fn check_names(&self, t: &Avro) -> Result<(), String> {
        match t {
            Avro::Ref(_) => self.resolve(t).map(|_| ()),
            Avro::Record { fields, .. } => fields.iter().try_for_each(|f| self.check_names(&f.ty)),
            Avro::Array(t) | Avro::Map(t) => self.check_names(t),
            Avro::Union(branches) => branches.iter().try_for_each(|b| self.check_names(b)),
            _ => Ok(()),
        }
    }

    fn resolve<'a>(&'a self, t: &'a Avro) -> Result<&'a Avro, String> {
        match t {
            // Types are kept by their bare names: a full name (`com.acme.Address`, with the
            // namespace) finds its type by the part after the last dot.
            Avro::Ref(n) => match self
                .named
                .get(n)
                .or_else(|| self.named.get(n.rsplit('.').next().unwrap_or(n)))
            {
                Some(Avro::Ref(_)) | None => Err(format!("unknown type {n}")),
                Some(t) => Ok(t),
            },
            t => Ok(t),
        }
    }
}

/// Whether data written with `writer` can be read with `reader`; the error says where not.
pub fn can_read(reader: &Schema, writer: &Schema) -> Result<(), String> {
    let mut seen = HashSet::new();
    check(reader, &reader.root, writer, &writer.root, "", &mut seen)
}

fn check(
    rs: &Schema,
    r: &Avro,
    ws: &Schema,
    w: &Avro,
    at: &str,
    seen: &mut HashSet<(String, String)>,
) -> Result<(), String> {
    let r = rs.resolve(r)?;
    let w = ws.resolve(w)?;
    use Avro::*;
    let here = if at.is_empty() { "the root" } else { at };
    match (r, w) {
        (_, Union(wb)) => {
            for b in wb {
                check(rs, r, ws, b, at, seen)?;
            }
            Ok(())
        }
        (Union(rb), _) => {
            if rb
                .iter()
                .any(|b| check(rs, b, ws, w, at, &mut seen.clone()).is_ok())
            {
                Ok(())
            } else {
                Err(format!(
                    "{here}: no branch of the reader's union reads {}",
                    kind(w)
                ))
            }
        }
        (Null, Null)
        | (Boolean, Boolean)
        | (Int, Int)
        | (Long, Long)
        | (Float, Float)
        | (Double, Double)
        | (Bytes, Bytes)
        | (String, String) => Ok(()),
        (Long, Int) | (Float, Int | Long) | (Double, Int | Long | Float) => Ok(()),
        (String, Bytes) | (Bytes, String) => Ok(()),
        (
            Record {
                name: rn,
                fields: rf,
            },
            Record {
                name: wn,
                fields: wf,
            },
        ) => {
            // Recursive types: a pair of records already under check is assumed to match.
            if !seen.insert((rn.clone(), wn.clone())) {
                return Ok(());
            }
            for f in rf {
                let path = if at.is_empty() {
                    f.name.clone()
                } else {
                    format!("{at}.{}", f.name)
                };
                match wf.iter().find(|x| x.name == f.name) {
                    Some(x) => check(rs, &f.ty, ws, &x.ty, &path, seen)?,
                    None if f.has_default => {}
                    None => {
                        return Err(format!(
                            "field {path} is missing from the data and has no default"
                        ))
                    }
                }
            }
            Ok(())
        }
        (
            Enum {
                symbols: rsym,
                has_default,
                ..
            },
            Enum { symbols: wsym, .. },
        ) => match wsym.iter().find(|s| !rsym.contains(s)) {
            Some(s) if !has_default => {
                Err(format!("{here}: enum symbol {s} is unknown to the reader"))
            }
            _ => Ok(()),
        },
        (Array(ri), Array(wi)) => check(rs, ri, ws, wi, &format!("{here}[]"), seen),
        (Map(rv), Map(wv)) => check(rs, rv, ws, wv, &format!("{here}{{}}"), seen),
        (Fixed { size: a, .. }, Fixed { size: b, .. }) if a == b => Ok(()),
        _ => Err(format!("{here}: {} cannot be read as {}", kind(w), kind(r))),
    }
}

fn kind(t: &Avro) -> &'static str {
    match t {
        Avro::Null => "null",
        Avro::Boolean => "boolean",
        Avro::Int => "int",
        Avro::Long => "long",
        Avro::Float => "float",
        Avro::Double => "double",
        Avro::Bytes => "bytes",
        Avro::String => "string",
        Avro::Record { .. } => "a record",
        Avro::Enum { .. } => "an enum",
        Avro::Array(_) => "an array",
        Avro::Map(_) => "a map",
        Avro::Union(_) => "a union",
        Avro::Fixed { .. } => "a fixed",
        Avro::Ref(_) => "a named type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Schema {
        parse(text.as_bytes()).unwrap()
    }

    const V1: &str = r#"{"type":"record","name":"User","fields":[
        {"name":"name","type":["null","string"]},{"name":"age","type":["null","int"]}]}"#;

    /// Found by the `avro_schema` fuzz target: a schema using a type it never defines parsed,
    /// and then could not read its own data.
    #[test]
    fn given_an_undefined_type_or_a_repeated_field_then_the_schema_is_refused() {
        for text in [
            r#"{"type":"record","name":"U","fields":[{"name":"id","type":"syng"}]}"#,
            r#"{"type":"array","items":["null","Nowhere"]}"#,
            r#"{"type":"map","values":{"type":"Missing"}}"#,
        ] {
            let e = parse(text.as_bytes()).unwrap_err();
            assert!(e.contains("unknown type"), "{text}: {e}");
        }
        // Found by the same target: two fields of one name (the reader matched the first).
        let e = parse(
            br#"{"type":"record","name":"U","fields":[{"name":"a","type":"int"},{"name":"a","type":"string"}]}"#,
        )
        .unwrap_err();
        assert!(e.contains("two fields named a"), "{e}");
        // A use by full name (namespace and name) finds its type.
        let ns = s(
            r#"{"type":"record","name":"U","namespace":"com.acme","fields":[
            {"name":"home","type":{"type":"record","name":"Address","fields":[{"name":"c","type":"string"}]}},
            {"name":"work","type":["null","com.acme.Address"]}]}"#,
        );
        can_read(&ns, &ns).unwrap();
        // Recursion through its own name is a use of a defined type.
        let r = s(r#"{"type":"record","name":"N","fields":[{"name":"next","type":["null","N"]}]}"#);
        can_read(&r, &r).unwrap();
    }

    #[test]
    fn given_an_added_field_then_it_needs_a_default_to_read_old_data() {
        let with_default = s(r#"{"type":"record","name":"User2","fields":[
            {"name":"name","type":["null","string"]},{"name":"age","type":["null","int"]},
            {"name":"email","type":["null","string"],"default":null}]}"#);
        let without = s(r#"{"type":"record","name":"User3","fields":[
            {"name":"name","type":["null","string"]},{"name":"age","type":["null","int"]},
            {"name":"score","type":"double"}]}"#);
        let v1 = s(V1);
        assert!(can_read(&with_default, &v1).is_ok());
        assert!(
            can_read(&v1, &with_default).is_ok(),
            "old readers skip the new field"
        );
        let e = can_read(&without, &v1).unwrap_err();
        assert!(e.contains("score") && e.contains("no default"), "{e}");
    }

    #[test]
    fn given_type_changes_then_only_promotions_read() {
        let long_age = s(r#"{"type":"record","name":"U","fields":[{"name":"age","type":"long"}]}"#);
        let int_age = s(r#"{"type":"record","name":"U","fields":[{"name":"age","type":"int"}]}"#);
        let str_age =
            s(r#"{"type":"record","name":"U","fields":[{"name":"age","type":"string"}]}"#);
        assert!(can_read(&long_age, &int_age).is_ok());
        assert!(can_read(&int_age, &long_age).is_err());
        let e = can_read(&str_age, &int_age).unwrap_err();
        assert!(e.contains("age"), "{e}");
        // A union writer: every branch must be readable.
        let opt =
            s(r#"{"type":"record","name":"U","fields":[{"name":"age","type":["null","int"]}]}"#);
        assert!(can_read(&int_age, &opt).is_err());
        assert!(can_read(&opt, &int_age).is_ok());
    }

    #[test]
    fn given_enums_arrays_maps_and_recursion_then_rules_apply() {
        let e1 = s(r#"{"type":"enum","name":"C","symbols":["A","B"]}"#);
        let e2 = s(r#"{"type":"enum","name":"C","symbols":["A","B","C"]}"#);
        assert!(can_read(&e2, &e1).is_ok());
        assert!(can_read(&e1, &e2).is_err());
        let a1 = s(r#"{"type":"array","items":"int"}"#);
        let a2 = s(r#"{"type":"array","items":"long"}"#);
        assert!(can_read(&a2, &a1).is_ok() && can_read(&a1, &a2).is_err());
        let m = s(r#"{"type":"map","values":"string"}"#);
        assert!(can_read(&m, &m).is_ok() && can_read(&m, &a1).is_err());
        let list = r#"{"type":"record","name":"Node","fields":[
            {"name":"v","type":"int"},{"name":"next","type":["null","Node"]}]}"#;
        assert!(can_read(&s(list), &s(list)).is_ok());
        let logical = s(r#"{"type":"record","name":"T","fields":[
            {"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#);
        assert!(can_read(&logical, &logical).is_ok());
    }

    #[test]
    fn given_bad_definitions_then_parse_says_why() {
        assert!(parse(b"not json").unwrap_err().contains("not JSON"));
        assert!(parse(br#"{"type":"record","name":"X"}"#)
            .unwrap_err()
            .contains("fields"));
        let deep = format!("{}\"int\"{}", "[".repeat(100), "]".repeat(100));
        assert!(parse(deep.as_bytes()).unwrap_err().contains("deeply"));
    }
}
