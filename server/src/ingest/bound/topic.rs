//! `--events-topic`: how an engine's topic names its worker and model.

/// `--events-topic`: literal text around `{host}` and `{model}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate {
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Host,
    Model,
}

/// An `--events-topic` that is not a template of the engines' topics.
#[derive(Debug, thiserror::Error)]
pub enum BadTopic {
    #[error("{template:?}: {{host}} and {{model}} need text between them")]
    Adjacent { template: String },
    #[error("{template:?}: needs {tag} exactly once (like kv@{{host}}@{{model}})")]
    Count { template: String, tag: &'static str },
}

impl std::str::FromStr for TopicTemplate {
    type Err = BadTopic;

    fn from_str(template: &str) -> Result<Self, BadTopic> {
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            let next = [("{host}", Part::Host), ("{model}", Part::Model)]
                .into_iter()
                .filter_map(|(tag, part)| rest.find(tag).map(|at| (at, tag, part)))
                .min_by_key(|(at, _, _)| *at);
            match next {
                Some((at, tag, part)) => {
                    if at > 0 {
                        parts.push(Part::Text(rest[..at].to_string()));
                    } else if matches!(parts.last(), Some(Part::Host | Part::Model)) {
                        let template = template.to_string();
                        return Err(BadTopic::Adjacent { template });
                    }
                    parts.push(part);
                    rest = &rest[at + tag.len()..];
                }
                None => {
                    parts.push(Part::Text(rest.to_string()));
                    rest = "";
                }
            }
        }
        for (part, tag) in [(Part::Host, "{host}"), (Part::Model, "{model}")] {
            if parts.iter().filter(|p| **p == part).count() != 1 {
                let template = template.to_string();
                return Err(BadTopic::Count { template, tag });
            }
        }
        Ok(TopicTemplate { parts })
    }
}

impl TopicTemplate {
    /// The host and model a topic names, if it has the template's form: each field ends
    /// at the first occurrence of the text after it (the last one takes the rest).
    pub fn parse(&self, topic: &str) -> Option<(String, String)> {
        let (mut host, mut model, mut rest) = (None, None, topic);
        for (i, part) in self.parts.iter().enumerate() {
            match part {
                Part::Text(t) => rest = rest.strip_prefix(t.as_str())?,
                field => {
                    let end = match self.parts.get(i + 1) {
                        Some(Part::Text(t)) => rest.find(t.as_str())?,
                        _ => rest.len(),
                    };
                    let value = &rest[..end];
                    if value.is_empty() {
                        return None;
                    }
                    match field {
                        Part::Host => host = Some(value.to_string()),
                        _ => model = Some(value.to_string()),
                    }
                    rest = &rest[end..];
                }
            }
        }
        rest.is_empty().then_some(())?;
        Some((host?, model?))
    }
}
