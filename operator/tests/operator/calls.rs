//! Every request the operator's tests see it make, mapped to the verbs the API server authorizes
//! it as (`rbac::authorized_as`): each must be allowed by the rules the chart grants
//! (`rbac::CLUSTER_RULES`, `rbac::NAMESPACE_RULES`), and is remembered (per thread: a test's
//! current-thread runtime) so a test can check every rule is used.

use std::cell::RefCell;
use std::collections::BTreeSet;

use dpukv_operator::rbac::{CLUSTER_RULES, NAMESPACE_RULES, allows, authorized_as};

type Grant = (String, String, String);

thread_local! {
    static SEEN: RefCell<BTreeSet<Grant>> = const { RefCell::new(BTreeSet::new()) };
}

/// Checks `req` against the rules (panics naming the missing permission) and remembers it.
pub fn check<B>(req: &http::Request<B>) {
    let ct = req.headers().get("content-type").and_then(|v| v.to_str().ok());
    let uri = req.uri();
    let Some((group, resource, verbs)) =
        authorized_as(req.method().as_str(), uri.path(), uri.query().unwrap_or_default(), ct)
    else {
        return;
    };
    for v in verbs {
        assert!(
            allows(CLUSTER_RULES, &group, &resource, v) || allows(NAMESPACE_RULES, &group, &resource, v),
            "the operator calls {} {uri} (verb {v} on {resource:?} of group {group:?}), which no rule allows: \
             add it to operator/src/rbac.rs",
            req.method()
        );
        SEEN.with(|s| s.borrow_mut().insert((group.clone(), resource.clone(), v.to_string())));
    }
}

/// What this thread's requests were authorized as since the last [`reset`].
pub fn seen() -> BTreeSet<Grant> {
    SEEN.with(|s| s.borrow().clone())
}

/// Forgets what was seen.
pub fn reset() {
    SEEN.with(|s| s.borrow_mut().clear());
}
