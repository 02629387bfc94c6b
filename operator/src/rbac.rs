//! The Kubernetes permissions the operator needs — exactly what its code calls, no more — as
//! data. The chart's ClusterRole and Role include files generated from it (`crdgen --rbac DIR`
//! writes `charts/dpukv/files/operator-{clusterrole,role}-rules.yaml`; a test fails when they
//! differ), and the operator's tests map every request they see it make to the verbs the API
//! server authorizes it as ([`authorized_as`]): each must be allowed, and every rule must be
//! used by some request.

/// One rule: verbs on one resource (a subresource as `resource/sub`) of one API group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// The API group (`""`: the core group).
    pub group: &'static str,
    /// The resource.
    pub resource: &'static str,
    /// The verbs.
    pub verbs: &'static [&'static str],
}

/// Cluster-wide: the `DpuKvCluster`s and their children in every namespace, and the nodes.
pub const CLUSTER_RULES: &[Rule] = &[
    // The controller watches the clusters (`run`); the finalizer of a cluster with an external
    // etcd is added and removed with JSON patches (`etcd_keys`).
    Rule { group: "dpukv.io", resource: "dpukvclusters", verbs: &["get", "list", "watch", "patch"] },
    // The reconciler's status (server-side apply on the status subresource).
    Rule { group: "dpukv.io", resource: "dpukvclusters/status", verbs: &["patch"] },
    // `DpuKvOperation`s: watched, their finalizer added and removed, their status written; the
    // cluster each names is read (`get` above).
    Rule { group: "dpukv.io", resource: "dpukvoperations", verbs: &["list", "watch", "patch"] },
    Rule { group: "dpukv.io", resource: "dpukvoperations/status", verbs: &["patch"] },
    // The backup resources: watched, their status written; a schedule's finalizer added and
    // removed (docs/backup.md §7).
    Rule { group: "dpukv.io", resource: "dpukvbackups", verbs: &["list", "watch"] },
    Rule { group: "dpukv.io", resource: "dpukvbackups/status", verbs: &["patch"] },
    Rule { group: "dpukv.io", resource: "dpukvbackupschedules", verbs: &["list", "watch", "patch"] },
    Rule { group: "dpukv.io", resource: "dpukvbackupschedules/status", verbs: &["patch"] },
    Rule { group: "dpukv.io", resource: "dpukvrestores", verbs: &["list", "watch"] },
    Rule { group: "dpukv.io", resource: "dpukvrestores/status", verbs: &["patch"] },
    // Children: applied server-side (patch, and create when the apply creates them), watched as
    // owned objects; the node StatefulSet is also read (its running size, before a scale-in).
    Rule { group: "apps", resource: "statefulsets", verbs: &["get", "list", "watch", "create", "patch"] },
    Rule { group: "apps", resource: "deployments", verbs: &["list", "watch", "create", "patch"] },
    Rule { group: "", resource: "services", verbs: &["list", "watch", "create", "patch"] },
    // The node ConfigMaps are named by their content: one a pod template no pod runs any more
    // is deleted (`controller`).
    Rule { group: "", resource: "configmaps", verbs: &["list", "watch", "create", "patch", "delete"] },
    Rule { group: "policy", resource: "poddisruptionbudgets", verbs: &["list", "watch", "create", "patch"] },
    Rule { group: "networking.k8s.io", resource: "networkpolicies", verbs: &["list", "watch", "create", "patch"] },
    // The clusters' certificates (`tls`): their CA and leaf Secrets read, created and renewed;
    // never listed or watched (a reconcile every minute looks at them).
    Rule { group: "", resource: "secrets", verbs: &["get", "create", "patch"] },
    // `tls.certManager`: the clusters' cert-manager Certificates, applied.
    Rule { group: "cert-manager.io", resource: "certificates", verbs: &["create", "patch"] },
    // Events on the clusters (`events`): kube's recorder creates one, and patches its series
    // when it happens again.
    Rule { group: "events.k8s.io", resource: "events", verbs: &["create", "patch"] },
    // `device.mode: Auto` asks once what the nodes advertise; the nodes' zones are watched
    // (metadata only) for the zones ConfigMap.
    Rule { group: "", resource: "nodes", verbs: &["list", "watch"] },
    // A larger `storage.size` (or `etcd.managed.storage`) goes to each claim (`claims`).
    Rule { group: "", resource: "persistentvolumeclaims", verbs: &["get", "patch"] },
    // The node pods' revisions and readiness during a rollout (a broken pod is restarted); a
    // watch of the operator's pods shows those the scheduler cannot place in the status.
    Rule { group: "", resource: "pods", verbs: &["list", "watch"] },
];

/// In the operator's own namespace: its leader-election Lease (`lease`).
pub const NAMESPACE_RULES: &[Rule] =
    &[Rule { group: "coordination.k8s.io", resource: "leases", verbs: &["get", "create", "update"] }];

/// The rules as a YAML list (what a Role's or ClusterRole's `rules:` holds).
pub fn rules_yaml(rules: &[Rule]) -> String {
    let list = |xs: &[&str]| xs.iter().map(|x| format!("{x:?}")).collect::<Vec<_>>().join(", ");
    let mut out =
        String::from("# Generated from operator/src/rbac.rs (`crdgen --rbac charts/dpukv/files`); do not edit.\n");
    for r in rules {
        out.push_str(&format!(
            "- apiGroups: [{}]\n  resources: [{}]\n  verbs: [{}]\n",
            list(&[r.group]),
            list(&[r.resource]),
            list(r.verbs)
        ));
    }
    out
}

/// What the API server authorizes a request as: its group, resource (with subresource) and
/// verbs — `None` for a path that names no resource. A GET is `get` with a name, else `list`, or
/// `watch` with `watch=true`; POST `create`; PUT `update`; DELETE `delete`; PATCH `patch`, and a
/// server-side apply (`application/apply-patch+yaml`) of an object, not a subresource, also
/// `create` (the apply creates an object that does not exist, and is authorized for that).
pub fn authorized_as(
    method: &str,
    path: &str,
    query: &str,
    content_type: Option<&str>,
) -> Option<(String, String, Vec<&'static str>)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    // /api/v1/... (core) or /apis/<group>/<version>/...
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        _ => rest,
    };
    let (resource, name, sub) = match rest {
        [resource] => (*resource, None, None),
        [resource, name] => (*resource, Some(*name), None),
        [resource, name, sub] => (*resource, Some(*name), Some(*sub)),
        _ => return None,
    };
    let watch = query.split('&').any(|kv| kv == "watch=true" || kv == "watch=1");
    let verbs: Vec<&'static str> = match (method, name) {
        ("GET", _) if watch => vec!["watch"],
        ("GET", Some(_)) => vec!["get"],
        ("GET", None) => vec!["list"],
        ("POST", _) => vec!["create"],
        ("PUT", _) => vec!["update"],
        ("DELETE", _) => vec!["delete"],
        ("PATCH", _) if content_type == Some("application/apply-patch+yaml") && sub.is_none() => {
            vec!["patch", "create"]
        }
        ("PATCH", _) => vec!["patch"],
        _ => return None,
    };
    let resource = match sub {
        Some(s) => format!("{resource}/{s}"),
        None => resource.to_string(),
    };
    Some((group.to_string(), resource, verbs))
}

/// Whether `rules` allow `verb` on `resource` of `group`.
pub fn allows(rules: &[Rule], group: &str, resource: &str, verb: &str) -> bool {
    rules.iter().any(|r| r.group == group && r.resource == resource && r.verbs.contains(&verb))
}

/// Every (group, resource, verb) `rules` grant.
pub fn grants(rules: &[Rule]) -> std::collections::BTreeSet<(String, String, String)> {
    rules
        .iter()
        .flat_map(|r| r.verbs.iter().map(move |v| (r.group.to_string(), r.resource.to_string(), v.to_string())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_map_to_the_verbs_the_api_server_checks() {
        let v = |m, p, q, ct| authorized_as(m, p, q, ct).map(|(g, r, v)| (g, r, v.join(",")));
        let t = |g: &str, r: &str, vs: &str| Some((g.to_string(), r.to_string(), vs.to_string()));
        assert_eq!(v("GET", "/api/v1/nodes", "", None), t("", "nodes", "list"));
        assert_eq!(
            v("GET", "/apis/apps/v1/statefulsets", "watch=true&resourceVersion=1", None),
            t("apps", "statefulsets", "watch")
        );
        assert_eq!(
            v("GET", "/apis/apps/v1/namespaces/db/statefulsets/demo-node", "", None),
            t("apps", "statefulsets", "get")
        );
        assert_eq!(
            v("PATCH", "/api/v1/namespaces/db/services/demo", "fieldManager=x", Some("application/apply-patch+yaml")),
            t("", "services", "patch,create")
        );
        assert_eq!(
            v(
                "PATCH",
                "/apis/dpukv.io/v1alpha1/namespaces/db/dpukvclusters/demo/status",
                "",
                Some("application/apply-patch+yaml")
            ),
            t("dpukv.io", "dpukvclusters/status", "patch")
        );
        assert_eq!(
            v("PATCH", "/api/v1/namespaces/db/services/demo", "", Some("application/merge-patch+json")),
            t("", "services", "patch")
        );
        assert_eq!(
            v("POST", "/apis/coordination.k8s.io/v1/namespaces/ops/leases", "", None),
            t("coordination.k8s.io", "leases", "create")
        );
        assert_eq!(
            v("PUT", "/apis/coordination.k8s.io/v1/namespaces/ops/leases/l", "", None),
            t("coordination.k8s.io", "leases", "update")
        );
        assert_eq!(v("GET", "/api/v1/namespaces", "", None), t("", "namespaces", "list"));
        assert_eq!(v("GET", "/version", "", None), None);
    }

    #[test]
    fn the_yaml_lists_every_rule() {
        let y = rules_yaml(CLUSTER_RULES);
        assert_eq!(y.matches("- apiGroups:").count(), CLUSTER_RULES.len());
        assert!(y.contains("- apiGroups: [\"\"]\n  resources: [\"nodes\"]\n  verbs: [\"list\", \"watch\"]\n"), "{y}");
    }
}
