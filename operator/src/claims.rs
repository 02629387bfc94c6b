//! Volume sizes after creation: a StatefulSet's `volumeClaimTemplates` never change (Kubernetes
//! refuses any change to them: 422), so a larger `storage.size` (or `etcd.managed.storage`) is
//! given to each existing claim instead — a patch of its `spec.resources.requests.storage`,
//! which the API server allows (growing only) when the claim's StorageClass has
//! `allowVolumeExpansion`. The applied StatefulSet keeps its live templates, and remembers the
//! size its claims were last brought to and for how many pods (`CLAIM_SIZE_ANNOTATION`): once
//! they all have it, nothing is read again until the cluster grows. A smaller size is refused (a volume cannot shrink): nothing is
//! patched, and the status says so.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};

use crate::controller::MANAGER;

/// The StatefulSet annotation holding the size its claims were brought to.
pub const CLAIM_SIZE_ANNOTATION: &str = "dpukv.io/claim-size";

/// The bytes a Kubernetes quantity stands for (`10Gi`, `500M`, `1.5Ti`, `1e3` aside): None when
/// it is not one this parser knows (then nothing is compared or patched).
pub fn quantity_bytes(q: &str) -> Option<u128> {
    let q = q.trim();
    let split = q.find(|ch: char| !(ch.is_ascii_digit() || ch == '.')).unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let mult: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        _ => return None,
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() || frac.len() > 18 {
        return None;
    }
    let int: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac_value: u128 = if frac.is_empty() { 0 } else { frac.parse().ok()? };
    let scale = 10u128.pow(frac.len() as u32);
    Some(int.checked_mul(mult)? + frac_value.checked_mul(mult)? / scale)
}

/// The size of a StatefulSet's `data` claim template.
fn template_size(l: &StatefulSet) -> Option<String> {
    let t = l.spec.volume_claim_templates.as_ref()?.iter().find(|t| t.metadata.name.as_deref() == Some("data"))?;
    Some(t.spec.as_ref()?.resources.as_ref()?.requests.as_ref()?.get("storage")?.0.clone())
}

/// What a live StatefulSet's claims were brought to: the size, and how many pods' claims have
/// it (None: all of them — the template's own size, which new pods' claims get too).
fn brought_to(l: &StatefulSet) -> Option<(String, Option<i32>)> {
    if let Some((size, pods)) = l.annotations().get(CLAIM_SIZE_ANNOTATION).and_then(|a| a.split_once('/')) {
        return Some((size.to_string(), Some(pods.parse().unwrap_or(0))));
    }
    Some((template_size(l)?, None))
}

/// What became of a StatefulSet's claims this reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resize {
    /// Every claim has the size asked for.
    Done,
    /// Smaller than the claims: refused, nothing patched.
    ShrinkRefused {
        /// The claims' size.
        from: String,
        /// The size asked for.
        to: String,
    },
    /// Some claims are not at the size yet: not made yet (a new pod's; tried again next
    /// reconcile), or refused by the API server (say, a StorageClass without
    /// `allowVolumeExpansion`: its message).
    Pending(String),
}

/// Makes `set` keep `live`'s claim templates (they cannot change), and brings the claims of its
/// first `replicas` pods (`data-NAME-ORDINAL`) to the size `set` was rendered with. A claim a
/// new pod gets from the template has the template's size: it is brought up too (the
/// annotation counts the pods whose claims have the size, `SIZE/PODS`).
pub async fn keep_and_expand(
    client: &Client,
    ns: &str,
    set: &mut StatefulSet,
    live: Option<&StatefulSet>,
    replicas: i32,
) -> Result<Resize, kube::Error> {
    let wanted = template_size(set);
    let Some(l) = live else { return Ok(Resize::Done) };
    set.spec.volume_claim_templates = l.spec.volume_claim_templates.clone();
    if let Some(a) = l.annotations().get(CLAIM_SIZE_ANNOTATION) {
        set.annotations_mut().insert(CLAIM_SIZE_ANNOTATION.into(), a.clone());
    }
    let (Some(want), Some((had, pods))) = (wanted, brought_to(l)) else { return Ok(Resize::Done) };
    let (Some(w), Some(h)) = (quantity_bytes(&want), quantity_bytes(&had)) else { return Ok(Resize::Done) };
    if w < h {
        return Ok(Resize::ShrinkRefused { from: had, to: want });
    }
    if w == h && pods.is_none_or(|n| n >= replicas) {
        if pods.is_some_and(|n| n > replicas) {
            // Fewer pods now (a scale-in took their claims): those that come back are new claims.
            set.annotations_mut().insert(CLAIM_SIZE_ANNOTATION.into(), format!("{had}/{replicas}"));
        }
        return Ok(Resize::Done);
    }
    let name = l.name_any();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let mut pending = Vec::new();
    for o in 0..replicas.max(0) {
        let claim = format!("data-{name}-{o}");
        let Some(pvc) = pvcs.get_opt(&claim).await? else {
            pending.push(format!("{claim}: not made yet"));
            continue;
        };
        let current = pvc
            .spec
            .as_ref()
            .and_then(|s| s.resources.as_ref()?.requests.as_ref()?.get("storage").map(|q| q.0.clone()))
            .and_then(|q| quantity_bytes(&q));
        if current >= Some(w) {
            continue;
        }
        let patch = serde_json::json!({"spec": {"resources": {"requests": {"storage": want}}}});
        let pp = PatchParams { field_manager: Some(MANAGER.into()), ..PatchParams::default() };
        match pvcs.patch(&claim, &pp, &Patch::Merge(patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if (400..500).contains(&s.code) => pending.push(format!("{claim}: {}", s.message)),
            Err(e) => return Err(e),
        }
    }
    if !pending.is_empty() {
        return Ok(Resize::Pending(pending.join("; ")));
    }
    if template_size(l).is_some_and(|t| quantity_bytes(&t) == Some(w)) {
        set.annotations_mut().remove(CLAIM_SIZE_ANNOTATION);
    } else {
        set.annotations_mut().insert(CLAIM_SIZE_ANNOTATION.into(), format!("{want}/{replicas}"));
    }
    Ok(Resize::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_read_as_kubernetes_writes_them() {
        assert_eq!(quantity_bytes("10Gi"), Some(10 << 30));
        assert_eq!(quantity_bytes("1.5Ti"), Some(3 << 39));
        assert_eq!(quantity_bytes("500M"), Some(500_000_000));
        assert_eq!(quantity_bytes("0.5Gi"), Some(1 << 29));
        assert_eq!(quantity_bytes("1024"), Some(1024));
        assert!(quantity_bytes("20Gi") > quantity_bytes("10Gi"));
        assert!(quantity_bytes("1Ti") > quantity_bytes("1000Gi"));
        for bad in ["", "Gi", "1Qi", "1e3", "-1Gi", "."] {
            assert_eq!(quantity_bytes(bad), None, "{bad}");
        }
    }
}
