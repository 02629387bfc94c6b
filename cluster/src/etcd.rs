//! [`EtcdStore`]: the [`MetaStore`] on a real etcd (v3 API through `etcd-client`; tested against
//! etcd 3.4). Every operation has a deadline ([`EtcdOptions::op_timeout`]); a store that cannot
//! be reached answers [`MetaError::Unavailable`] rather than hanging, so a node's lease keeper can
//! tell "etcd is down" from "etcd is slow" by the clock alone.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare as ECompare, CompareOp, ConnectOptions, DeleteOptions, Error as EError, EventType, GetOptions,
    PutOptions, Txn as ETxn, TxnOp as ETxnOp, WatchOptions,
};
use tokio::sync::mpsc;
use tonic::Code;

use crate::meta::{
    Compare, KeyValue, LeaseId, MetaError, MetaStore, Result, Revision, Txn, TxnOp, TxnResult, WATCH_QUEUE, Watch,
    WatchEvent,
};

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Client URLs (`http://host:port`, or `https://host:port` with [`EtcdOptions::tls`]), any
    /// member of the cluster.
    pub endpoints: Vec<String>,
    /// Deadline of one request (and of connecting).
    pub op_timeout: Duration,
    /// TLS (for `https://` endpoints).
    pub tls: Option<EtcdTls>,
}

impl EtcdOptions {
    /// Options for these endpoints with a 2 s deadline per request, without TLS.
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> EtcdOptions {
        EtcdOptions {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            op_timeout: Duration::from_secs(2),
            tls: None,
        }
    }

    /// The same, over TLS.
    pub fn with_tls(self, tls: EtcdTls) -> EtcdOptions {
        EtcdOptions { tls: Some(tls), ..self }
    }
}

/// TLS to etcd: where the client configuration in force comes from (trusting etcd's CA, with a
/// client certificate for etcd's `--client-cert-auth`), asked at every new connection.
#[derive(Clone)]
pub struct EtcdTls(Arc<dyn Fn() -> Arc<rustls::ClientConfig> + Send + Sync>);

impl EtcdTls {
    /// `config` answers the configuration in force (say, `ClientTls::config` of `dpukv-net`).
    pub fn new(config: impl Fn() -> Arc<rustls::ClientConfig> + Send + Sync + 'static) -> EtcdTls {
        EtcdTls(Arc::new(config))
    }

    /// The configuration for a new connection: the one in force, speaking HTTP/2 (ALPN `h2`:
    /// etcd's TLS server picks gRPC's protocol by it).
    fn config(&self) -> Arc<rustls::ClientConfig> {
        let mut c = (*(self.0)()).clone();
        c.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(c)
    }
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EtcdTls")
    }
}

/// `host:port` of `url` (`scheme://host:port[/]`), and whether it is `https`.
fn endpoint_addr(url: &str) -> Result<(bool, String)> {
    let (https, rest) = if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else {
        (false, url)
    };
    let addr = rest.trim_end_matches('/');
    if addr.is_empty() || addr.contains('/') || !addr.contains(':') {
        return Err(MetaError::Invalid(format!("the etcd endpoint {url:?} is not scheme://host:port")));
    }
    Ok((https, addr.to_string()))
}

/// The name a server certificate must carry for `addr` (`host:port`, `[v6]:port`).
fn server_name(addr: &str) -> std::io::Result<rustls::pki_types::ServerName<'static>> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host:?}: {e}")))
}

/// A TLS connection to the first of `addrs` that answers (each within `timeout`).
async fn dial_tls(
    addrs: &[String],
    tls: &EtcdTls,
    timeout: Duration,
) -> std::io::Result<hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no etcd endpoint");
    for addr in addrs {
        let one = async {
            let tcp = tokio::net::TcpStream::connect(addr.as_str()).await?;
            tcp.set_nodelay(true)?;
            tokio_rustls::TlsConnector::from(tls.config()).connect(server_name(addr)?, tcp).await
        };
        match tokio::time::timeout(timeout, one).await {
            Ok(Ok(s)) => return Ok(hyper_util::rt::TokioIo::new(s)),
            Ok(Err(e)) => last = std::io::Error::new(e.kind(), format!("etcd at {addr}: {e}")),
            Err(_) => last = std::io::Error::new(std::io::ErrorKind::TimedOut, format!("etcd at {addr}: no answer")),
        }
    }
    Err(last)
}

/// A [`MetaStore`] on etcd. Clones share one connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    op_timeout: Duration,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("op_timeout", &self.op_timeout).finish_non_exhaustive()
    }
}

/// Maps a client error; `lease` names the lease the request was about, for `lease not found`.
fn map_err(e: EError, lease: Option<LeaseId>) -> MetaError {
    match e {
        EError::GRpcStatus(s) => {
            let msg = s.message().to_string();
            match s.code() {
                Code::NotFound if msg.contains("lease not found") => MetaError::LeaseNotFound(lease.unwrap_or(0)),
                Code::OutOfRange if msg.contains("compacted") => MetaError::Compacted(0),
                Code::InvalidArgument | Code::FailedPrecondition => MetaError::Invalid(msg),
                _ => MetaError::Unavailable(format!("etcd: {:?}: {msg}", s.code())),
            }
        }
        EError::LeaseKeepAliveError(m) if m.contains("not found") => MetaError::LeaseNotFound(lease.unwrap_or(0)),
        EError::InvalidArgs(m) => MetaError::Invalid(m),
        other => MetaError::Unavailable(format!("etcd: {other}")),
    }
}

fn kv(k: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: k.key().to_vec(),
        value: k.value().to_vec(),
        create_revision: k.create_revision(),
        mod_revision: k.mod_revision(),
        lease: (k.lease() != 0).then_some(k.lease()),
    }
}

/// The first key after every key starting with `prefix` (etcd's range end for a prefix: the
/// last byte below 0xff incremented, the 0xff bytes after it dropped; all 0xff: `\0`, every key
/// after).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn header_revision(h: Option<&etcd_client::ResponseHeader>) -> Result<Revision> {
    h.map(|h| h.revision()).ok_or_else(|| MetaError::Unavailable("etcd answered without a header".into()))
}

/// The etcd compares for one of ours. etcd treats a missing key as one with zero revisions, so
/// the revision compares also require the key to exist (version > 0).
fn compares(c: &Compare, out: &mut Vec<ECompare>) {
    match c {
        Compare::Absent(k) => out.push(ECompare::version(k.clone(), CompareOp::Equal, 0)),
        Compare::ModRevision(k, r) => {
            out.push(ECompare::version(k.clone(), CompareOp::Greater, 0));
            out.push(ECompare::mod_revision(k.clone(), CompareOp::Equal, *r));
        }
        Compare::CreateRevision(k, r) => {
            out.push(ECompare::version(k.clone(), CompareOp::Greater, 0));
            out.push(ECompare::create_revision(k.clone(), CompareOp::Equal, *r));
        }
        // etcd fails a value compare on a missing key.
        Compare::Value(k, v) => out.push(ECompare::value(k.clone(), CompareOp::Equal, v.clone())),
        // Over a range etcd requires every key in it to pass (an empty range compares a key of
        // zero revisions, which passes).
        Compare::UnchangedSince(prefix, r) => {
            out.push(ECompare::mod_revision(prefix.clone(), CompareOp::Less, r + 1).with_prefix())
        }
    }
}

fn op(o: &TxnOp) -> ETxnOp {
    match o {
        TxnOp::Put { key, value, lease } => {
            ETxnOp::put(key.clone(), value.clone(), lease.map(|l| PutOptions::new().with_lease(l)))
        }
        TxnOp::Delete { key } => ETxnOp::delete(key.clone(), None),
    }
}

fn lease_of(t: &Txn) -> Option<LeaseId> {
    t.then.iter().chain(&t.otherwise).find_map(|o| match o {
        TxnOp::Put { lease, .. } => *lease,
        TxnOp::Delete { .. } => None,
    })
}

impl EtcdStore {
    /// Connects (lazily: the first request finds out whether etcd is there; see
    /// [`EtcdStore::connect_checked`]).
    pub async fn connect(opts: &EtcdOptions) -> Result<EtcdStore> {
        if opts.endpoints.is_empty() {
            return Err(MetaError::Invalid("no etcd endpoints".into()));
        }
        let mut addrs = Vec::with_capacity(opts.endpoints.len());
        for url in &opts.endpoints {
            let (https, addr) = endpoint_addr(url)?;
            if https != opts.tls.is_some() {
                return Err(MetaError::Invalid(if https {
                    format!("the etcd endpoint {url} is https: it needs TLS (--etcd-ca, --etcd-cert, --etcd-key)")
                } else {
                    format!("the etcd endpoint {url} is not https, and TLS to etcd is configured")
                }));
            }
            addrs.push(addr);
        }
        let co = ConnectOptions::new()
            .with_timeout(opts.op_timeout)
            .with_connect_timeout(opts.op_timeout)
            .with_keep_alive(Duration::from_secs(1), opts.op_timeout)
            .with_keep_alive_while_idle(true);
        let client = match &opts.tls {
            None => Client::connect(&opts.endpoints, Some(co)).await.map_err(|e| map_err(e, None))?,
            Some(tls) => {
                // The channel's own URI only names the first endpoint for the requests' origin;
                // the connector dials (and fails over among) all of them, with TLS.
                let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", addrs[0]))
                    .map_err(|e| MetaError::Invalid(format!("etcd endpoint {}: {e}", addrs[0])))?
                    .timeout(opts.op_timeout)
                    .connect_timeout(opts.op_timeout)
                    .http2_keep_alive_interval(Duration::from_secs(1))
                    .keep_alive_timeout(opts.op_timeout)
                    .keep_alive_while_idle(true);
                let (addrs, tls, timeout) = (Arc::new(addrs), tls.clone(), opts.op_timeout);
                let connector = tower::service_fn(move |_: tonic::transport::Uri| {
                    let (addrs, tls) = (addrs.clone(), tls.clone());
                    async move { dial_tls(&addrs, &tls, timeout).await }
                });
                let channel = endpoint.connect_with_connector_lazy(connector);
                Client::from_channel(etcd_client::Channel::Tonic(channel), Some(co))
                    .await
                    .map_err(|e| map_err(e, None))?
            }
        };
        Ok(EtcdStore { client, op_timeout: opts.op_timeout })
    }

    /// Connects and reads once, so an unreachable etcd is an error now, naming the endpoints.
    pub async fn connect_checked(opts: &EtcdOptions) -> Result<EtcdStore> {
        let s = EtcdStore::connect(opts).await?;
        s.get(b"/").await.map_err(|e| MetaError::Unavailable(format!("etcd at {}: {e}", opts.endpoints.join(","))))?;
        Ok(s)
    }

    async fn timed<T>(&self, f: impl Future<Output = Result<T>>) -> Result<T> {
        tokio::time::timeout(self.op_timeout, f).await.unwrap_or_else(|_| {
            Err(MetaError::Unavailable(format!("etcd did not answer within {:?}", self.op_timeout)))
        })
    }
}

impl MetaStore for EtcdStore {
    async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>> {
        let mut c = self.client.clone();
        self.timed(async move {
            let r = c.get(key.to_vec(), None).await.map_err(|e| map_err(e, None))?;
            Ok(r.kvs().first().map(kv))
        })
        .await
    }

    async fn range(&self, prefix: &[u8]) -> Result<(Vec<KeyValue>, Revision)> {
        if prefix.is_empty() {
            return Err(MetaError::Invalid("an empty prefix".into()));
        }
        let mut c = self.client.clone();
        self.timed(async move {
            let r =
                c.get(prefix.to_vec(), Some(GetOptions::new().with_prefix())).await.map_err(|e| map_err(e, None))?;
            Ok((r.kvs().iter().map(kv).collect(), header_revision(r.header())?))
        })
        .await
    }

    async fn range_except(&self, prefix: &[u8], except: &[u8]) -> Result<(Vec<KeyValue>, Revision)> {
        crate::meta::check_except(prefix, except)?;
        // Two ranges, [prefix, except) and [end of except, end of prefix), read by one
        // transaction: at one revision.
        let ops = vec![
            ETxnOp::get(prefix.to_vec(), Some(GetOptions::new().with_range(except.to_vec()))),
            ETxnOp::get(prefix_end(except), Some(GetOptions::new().with_range(prefix_end(prefix)))),
        ];
        let mut c = self.client.clone();
        self.timed(async move {
            let r = c.txn(ETxn::new().and_then(ops)).await.map_err(|e| map_err(e, None))?;
            let mut kvs = Vec::new();
            for op in r.op_responses() {
                if let etcd_client::TxnOpResponse::Get(g) = op {
                    kvs.extend(g.kvs().iter().map(kv));
                }
            }
            Ok((kvs, header_revision(r.header())?))
        })
        .await
    }

    async fn txn(&self, t: Txn) -> Result<TxnResult> {
        if t.then
            .iter()
            .chain(&t.otherwise)
            .any(|o| matches!(o, TxnOp::Put { key, .. } | TxnOp::Delete { key } if key.is_empty()))
        {
            return Err(MetaError::Invalid("an empty key".into()));
        }
        let mut when = Vec::new();
        t.when.iter().for_each(|c| compares(c, &mut when));
        let etxn = ETxn::new()
            .when(when)
            .and_then(t.then.iter().map(op).collect::<Vec<_>>())
            .or_else(t.otherwise.iter().map(op).collect::<Vec<_>>());
        let lease = lease_of(&t);
        let mut c = self.client.clone();
        self.timed(async move {
            let r = c.txn(etxn).await.map_err(|e| map_err(e, lease))?;
            Ok(TxnResult { succeeded: r.succeeded(), revision: header_revision(r.header())? })
        })
        .await
    }

    async fn delete_prefix(&self, prefix: &[u8]) -> Result<u64> {
        if prefix.is_empty() {
            return Err(MetaError::Invalid("an empty prefix".into()));
        }
        let mut c = self.client.clone();
        self.timed(async move {
            // One DeleteRange over [prefix, prefix + 1): one revision for all of them.
            let r = c
                .delete(prefix.to_vec(), Some(DeleteOptions::new().with_prefix()))
                .await
                .map_err(|e| map_err(e, None))?;
            Ok(r.deleted().max(0) as u64)
        })
        .await
    }

    async fn grant(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = ttl.as_millis().div_ceil(1000).max(1) as i64;
        let mut c = self.client.clone();
        self.timed(async move {
            let r = c.lease_grant(secs, None).await.map_err(|e| map_err(e, None))?;
            if !r.error().is_empty() {
                return Err(MetaError::Invalid(r.error().to_string()));
            }
            Ok(r.id())
        })
        .await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<()> {
        let mut c = self.client.clone();
        self.timed(async move {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await.map_err(|e| map_err(e, Some(lease)))?;
            keeper.keep_alive().await.map_err(|e| map_err(e, Some(lease)))?;
            match stream.message().await.map_err(|e| map_err(e, Some(lease)))? {
                Some(r) if r.ttl() > 0 => Ok(()),
                Some(_) => Err(MetaError::LeaseNotFound(lease)),
                None => Err(MetaError::Unavailable("etcd closed the keep-alive stream".into())),
            }
        })
        .await
    }

    async fn revoke(&self, lease: LeaseId) -> Result<()> {
        let mut c = self.client.clone();
        self.timed(async move {
            c.lease_revoke(lease).await.map_err(|e| map_err(e, Some(lease)))?;
            Ok(())
        })
        .await
    }

    async fn watch(&self, prefix: &[u8], from: Revision) -> Result<Watch> {
        if prefix.is_empty() {
            return Err(MetaError::Invalid("an empty prefix".into()));
        }
        let mut c = self.client.clone();
        // etcd reads a start revision of 0 as "from now", as the trait does.
        let opts = WatchOptions::new().with_prefix().with_start_revision(from.max(0));
        let mut stream =
            self.timed(async move { c.watch(prefix.to_vec(), Some(opts)).await.map_err(|e| map_err(e, None)) }).await?;
        // One slot beyond the queue is kept for the error that ends a lagging watch.
        let (tx, rx) = mpsc::channel(WATCH_QUEUE + 1);
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = tx.closed() => return,
                };
                let resp = match msg {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        let _ = tx.try_send(Err(MetaError::Unavailable("etcd ended the watch".into())));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.try_send(Err(map_err(e, None)));
                        return;
                    }
                };
                if resp.compact_revision() > 0 {
                    let _ = tx.try_send(Err(MetaError::Compacted(resp.compact_revision())));
                    return;
                }
                if resp.canceled() {
                    let _ = tx.try_send(Err(MetaError::Unavailable(format!(
                        "etcd cancelled the watch: {}",
                        resp.cancel_reason()
                    ))));
                    return;
                }
                for ev in resp.events() {
                    let Some(k) = ev.kv() else { continue };
                    let ev = match ev.event_type() {
                        EventType::Put => WatchEvent::Put(kv(k)),
                        EventType::Delete => WatchEvent::Delete { key: k.key().to_vec(), revision: k.mod_revision() },
                    };
                    if tx.capacity() <= 1 {
                        let _ = tx.try_send(Err(MetaError::WatchLagged));
                        return;
                    }
                    if tx.try_send(Ok(ev)).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Watch::new(rx))
    }
}
