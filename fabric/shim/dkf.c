/*
 * dkf: the few libfabric calls dpukv makes, as plain functions over opaque handles.
 *
 * libfabric's API is mostly `static inline` functions that call through each object's
 * operation tables, which Rust cannot call directly; this file gives them a linkable form and
 * keeps every libfabric structure on this side. Rust (fabric/src/ffi.rs) sees only the handles
 * below, buffer indexes and integers.
 *
 * One connection (struct dkf_conn) is a connected FI_EP_MSG endpoint with FI_MSG, its own
 * domain, event queue (connection events) and completion queue (sends and receives), both with
 * a file descriptor to wait on (FI_WAIT_FD), and one registered region holding `nbufs` receive
 * buffers followed by `nbufs` send buffers of `bufsize` bytes each, registered once for the
 * connection's lifetime. An operation's context is the address of its buffer's `fi_context2`
 * slot, so a completion names its buffer by index.
 *
 * Every function returns 0 or a positive count on success and a negative libfabric error code
 * (-FI_E*) on failure; dkf_strerror names it. -FI_EAGAIN means "nothing yet".
 *
 * libfabric is loaded when first needed (dlopen of libfabric.so.1), not linked: the few
 * functions it exports that this file calls (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric,
 * fi_strerror) are looked up then; everything else goes through the objects' operation tables.
 * A process that never opens a fabric endpoint runs where libfabric is not installed, and one
 * that does gets -FI_ENOSYS (with dkf_load_error saying why) instead of failing to start.
 *
 * Not thread-safe: the Rust side serialises calls on one handle (a mutex per connection).
 */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>

#define DKF_VERSION FI_VERSION(1, 9)

/* A fabric, shared by a listener and the connections it accepted (counted). */
struct dkf_fabric {
	struct fid_fabric *fabric;
	long refs;
};

struct dkf_listener {
	struct dkf_fabric *fab;
	struct fi_info *info;
	struct fid_eq *eq;
	struct fid_pep *pep;
	size_t bufsize, nbufs;
};

struct dkf_conn {
	struct dkf_fabric *fab;
	struct fi_info *info;
	struct fid_domain *domain;
	struct fid_eq *eq;
	struct fid_cq *cq;
	struct fid_ep *ep;
	struct fid_mr *mr;
	void *desc;
	uint8_t *mem;
	struct fi_context2 *ctx;
	size_t bufsize, nbufs;
	int connected, shut;
};

/* One completion: which buffer, whether it was a receive, and its length. */
struct dkf_completion {
	uint64_t index;
	uint64_t len;
	int32_t recv;
	int32_t error; /* 0, or a negative error code (the operation failed) */
};

/* libfabric's exported functions, looked up once. */
static struct {
	int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *, struct fi_info **);
	void (*freeinfo)(struct fi_info *);
	struct fi_info *(*dupinfo)(const struct fi_info *);
	int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
	const char *(*strerror)(int);
} fi;
static char load_error[256];
static int loaded; /* 1 loaded, -1 failed */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static void load(void)
{
	void *h = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		snprintf(load_error, sizeof load_error, "cannot load libfabric.so.1: %s", dlerror());
		loaded = -1;
		return;
	}
	*(void **)&fi.getinfo = dlsym(h, "fi_getinfo");
	*(void **)&fi.freeinfo = dlsym(h, "fi_freeinfo");
	*(void **)&fi.dupinfo = dlsym(h, "fi_dupinfo");
	*(void **)&fi.fabric = dlsym(h, "fi_fabric");
	*(void **)&fi.strerror = dlsym(h, "fi_strerror");
	uint32_t (*version)(void);
	*(void **)&version = dlsym(h, "fi_version");
	if (!fi.getinfo || !fi.freeinfo || !fi.dupinfo || !fi.fabric || !fi.strerror || !version) {
		snprintf(load_error, sizeof load_error, "libfabric.so.1 lacks a function dpukv calls");
		loaded = -1;
		return;
	}
	/* The structures this file reads are the headers' (built against): the library must be at
	 * least that version (libfabric keeps older layouts working for newer libraries, not the
	 * other way round). */
	uint32_t v = version(), built = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
	if (FI_MAJOR(v) != FI_MAJOR(built) || FI_MINOR(v) < FI_MINOR(built)) {
		snprintf(load_error, sizeof load_error, "libfabric.so.1 is version %u.%u; dpukv was built against %u.%u",
			 FI_MAJOR(v), FI_MINOR(v), FI_MAJOR(built), FI_MINOR(built));
		loaded = -1;
		return;
	}
	loaded = 1;
}

/* 0 once libfabric is loaded, else -FI_ENOSYS (dkf_load_error says why). */
int dkf_load(void)
{
	pthread_once(&load_once, load);
	return loaded == 1 ? 0 : -FI_ENOSYS;
}

const char *dkf_load_error(void) { return load_error; }

const char *dkf_strerror(int code)
{
	if (dkf_load())
		return "libfabric is not loaded";
	return fi.strerror(code < 0 ? -code : code);
}

static void fabric_put(struct dkf_fabric *f)
{
	if (f && __atomic_sub_fetch(&f->refs, 1, __ATOMIC_ACQ_REL) == 0) {
		fi_close(&f->fabric->fid);
		free(f);
	}
}

static struct fi_info *hints_for(const char *prov)
{
	struct fi_info *h = fi.dupinfo(NULL);
	if (!h)
		return NULL;
	h->ep_attr->type = FI_EP_MSG;
	h->caps = FI_MSG;
	h->mode = FI_CONTEXT | FI_CONTEXT2;
	/* What verbs providers ask for; providers that need less ignore the bits. */
	h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_VIRT_ADDR;
	h->domain_attr->threading = FI_THREAD_DOMAIN;
	/* None named: libfabric's first choice for these capabilities. */
	if (prov && *prov)
		h->fabric_attr->prov_name = strdup(prov);
	return h;
}

static int open_eq(struct fid_fabric *fabric, struct fid_eq **eq)
{
	struct fi_eq_attr a = {.size = 16, .wait_obj = FI_WAIT_FD};
	return fi_eq_open(fabric, &a, eq, NULL);
}

int dkf_fabric_fd(struct fid *fid)
{
	int fd = -1;
	int r = fi_control(fid, FI_GETWAIT, &fd);
	return r < 0 ? r : fd;
}

/* Listens on node:service with provider `prov`. */
int dkf_listen(const char *prov, const char *node, const char *service, size_t bufsize, size_t nbufs,
	       struct dkf_listener **out)
{
	int r = dkf_load();
	if (r)
		return r;
	struct dkf_listener *l = calloc(1, sizeof *l);
	struct fi_info *hints = hints_for(prov);
	r = -FI_ENOMEM;
	if (!l || !hints)
		goto fail;
	l->bufsize = bufsize;
	l->nbufs = nbufs;
	r = fi.getinfo(DKF_VERSION, node, service, FI_SOURCE, hints, &l->info);
	if (r)
		goto fail;
	l->fab = calloc(1, sizeof *l->fab);
	if (!l->fab) {
		r = -FI_ENOMEM;
		goto fail;
	}
	l->fab->refs = 1;
	r = fi.fabric(l->info->fabric_attr, &l->fab->fabric, NULL);
	if (r) {
		free(l->fab);
		l->fab = NULL;
		goto fail;
	}
	if ((r = open_eq(l->fab->fabric, &l->eq)))
		goto fail;
	if ((r = fi_passive_ep(l->fab->fabric, l->info, &l->pep, NULL)))
		goto fail;
	if ((r = fi_pep_bind(l->pep, &l->eq->fid, 0)))
		goto fail;
	if ((r = fi_listen(l->pep)))
		goto fail;
	fi.freeinfo(hints);
	*out = l;
	return 0;
fail:
	if (hints)
		fi.freeinfo(hints);
	if (l) {
		if (l->pep)
			fi_close(&l->pep->fid);
		if (l->eq)
			fi_close(&l->eq->fid);
		fabric_put(l->fab);
		if (l->info)
			fi.freeinfo(l->info);
		free(l);
	}
	return r;
}

int dkf_listener_fd(struct dkf_listener *l) { return dkf_fabric_fd(&l->eq->fid); }

/* The port the listener is bound to (0 if it cannot tell). */
int dkf_listener_port(struct dkf_listener *l)
{
	struct sockaddr_storage a;
	size_t len = sizeof a;
	int r = fi_getname(&l->pep->fid, &a, &len);
	if (r)
		return r;
	if (a.ss_family == AF_INET)
		return ntohs(((struct sockaddr_in *)&a)->sin_port);
	if (a.ss_family == AF_INET6)
		return ntohs(((struct sockaddr_in6 *)&a)->sin6_port);
	return 0;
}

/* The provider the listener uses (its name lives as long as the listener). */
const char *dkf_listener_provider(struct dkf_listener *l) { return l->info->fabric_attr->prov_name; }

void dkf_listener_close(struct dkf_listener *l)
{
	if (!l)
		return;
	fi_close(&l->pep->fid);
	fi_close(&l->eq->fid);
	fabric_put(l->fab);
	fi.freeinfo(l->info);
	free(l);
}

static void conn_free(struct dkf_conn *c)
{
	if (!c)
		return;
	if (c->ep)
		fi_close(&c->ep->fid);
	if (c->mr)
		fi_close(&c->mr->fid);
	if (c->cq)
		fi_close(&c->cq->fid);
	if (c->eq)
		fi_close(&c->eq->fid);
	if (c->domain)
		fi_close(&c->domain->fid);
	fabric_put(c->fab);
	if (c->info)
		fi.freeinfo(c->info);
	free(c->mem);
	free(c->ctx);
	free(c);
}

/* The endpoint, queues and registered buffers of a connection on `info`; every receive buffer
 * posted (before the connection is established, so a peer never finds none). */
static int conn_open(struct dkf_fabric *fab, struct fi_info *info, size_t bufsize, size_t nbufs,
		     struct dkf_conn **out, int *ep_made)
{
	struct dkf_conn *c = calloc(1, sizeof *c);
	int r = -FI_ENOMEM;
	if (!c) {
		fi.freeinfo(info);
		return r;
	}
	__atomic_add_fetch(&fab->refs, 1, __ATOMIC_ACQ_REL);
	c->fab = fab;
	c->info = info;
	c->bufsize = bufsize;
	c->nbufs = nbufs;
	c->mem = aligned_alloc(4096, ((2 * nbufs * bufsize) + 4095) / 4096 * 4096);
	c->ctx = calloc(2 * nbufs, sizeof *c->ctx);
	if (!c->mem || !c->ctx)
		goto fail;
	if ((r = fi_domain(fab->fabric, info, &c->domain, NULL)))
		goto fail;
	if ((r = open_eq(fab->fabric, &c->eq)))
		goto fail;
	struct fi_cq_attr ca = {.size = 4 * nbufs, .format = FI_CQ_FORMAT_MSG, .wait_obj = FI_WAIT_FD};
	if ((r = fi_cq_open(c->domain, &ca, &c->cq, NULL)))
		goto fail;
	if ((r = fi_endpoint(c->domain, info, &c->ep, NULL)))
		goto fail;
	/* (From here the endpoint owns a connection request's handle.) */
	*ep_made = 1;
	if ((r = fi_ep_bind(c->ep, &c->eq->fid, 0)))
		goto fail;
	if ((r = fi_ep_bind(c->ep, &c->cq->fid, FI_TRANSMIT | FI_RECV)))
		goto fail;
	if ((r = fi_enable(c->ep)))
		goto fail;
	if ((r = fi_mr_reg(c->domain, c->mem, 2 * nbufs * bufsize, FI_SEND | FI_RECV, 0, 0, 0, &c->mr, NULL)))
		goto fail;
	c->desc = fi_mr_desc(c->mr);
	for (size_t i = 0; i < nbufs; i++) {
		ssize_t p = fi_recv(c->ep, c->mem + i * bufsize, bufsize, c->desc, 0, &c->ctx[i]);
		if (p) {
			r = (int)p;
			goto fail;
		}
	}
	*out = c;
	return 0;
fail:
	conn_free(c);
	return r;
}

/* The next connection request, if any (-FI_EAGAIN if none): its info, which the caller passes
 * to dkf_listener_accept_req or dkf_listener_reject_req (each consumes it). Other events on the
 * listener's queue are dropped. */
int dkf_listener_next(struct dkf_listener *l, struct fi_info **req)
{
	uint8_t buf[sizeof(struct fi_eq_cm_entry) + 64];
	struct fi_eq_cm_entry *e = (struct fi_eq_cm_entry *)buf;
	uint32_t event;
	for (;;) {
		ssize_t n = fi_eq_read(l->eq, &event, buf, sizeof buf, 0);
		if (n == -FI_EAVAIL) {
			struct fi_eq_err_entry err = {0};
			fi_eq_readerr(l->eq, &err, 0);
			continue;
		}
		if (n < 0)
			return (int)n;
		if (event != FI_CONNREQ)
			continue;
		*req = e->info;
		return 0;
	}
}

/* Refuses a request (the peer's connect fails at once) and frees it. */
void dkf_listener_reject_req(struct dkf_listener *l, struct fi_info *req)
{
	fi_reject(l->pep, req->handle, NULL, 0);
	fi.freeinfo(req);
}

/* Accepts a request: the connection is usable once dkf_conn_poll_cm reports it connected. On
 * failure the request is refused (the peer is told at once) and freed. */
int dkf_listener_accept_req(struct dkf_listener *l, struct fi_info *req, struct dkf_conn **out)
{
	/* conn_open owns the info from here (it frees it on failure, not its handle); the handle
	 * is refused unless an endpoint took it over (closing the endpoint ended it). */
	fid_t handle = req->handle;
	struct dkf_conn *c;
	int ep_made = 0;
	int r = conn_open(l->fab, req, l->bufsize, l->nbufs, &c, &ep_made);
	if (r) {
		if (!ep_made)
			fi_reject(l->pep, handle, NULL, 0);
		return r;
	}
	if ((r = fi_accept(c->ep, NULL, 0))) {
		conn_free(c);
		return r;
	}
	*out = c;
	return 0;
}

/* Starts connecting to node:service with provider `prov`. */
int dkf_connect(const char *prov, const char *node, const char *service, size_t bufsize, size_t nbufs,
		struct dkf_conn **out)
{
	int r = dkf_load();
	if (r)
		return r;
	struct fi_info *hints = hints_for(prov), *info = NULL;
	struct dkf_fabric *fab = NULL;
	r = -FI_ENOMEM;
	if (!hints)
		return r;
	r = fi.getinfo(DKF_VERSION, node, service, 0, hints, &info);
	fi.freeinfo(hints);
	if (r)
		return r;
	fab = calloc(1, sizeof *fab);
	if (!fab) {
		fi.freeinfo(info);
		return -FI_ENOMEM;
	}
	fab->refs = 1;
	if ((r = fi.fabric(info->fabric_attr, &fab->fabric, NULL))) {
		free(fab);
		fi.freeinfo(info);
		return r;
	}
	struct dkf_conn *c;
	int ep_made = 0;
	r = conn_open(fab, info, bufsize, nbufs, &c, &ep_made);
	fabric_put(fab); /* the connection holds it now (or it failed) */
	if (r)
		return r;
	if ((r = fi_connect(c->ep, info->dest_addr, NULL, 0))) {
		conn_free(c);
		return r;
	}
	*out = c;
	return 0;
}

int dkf_conn_eq_fd(struct dkf_conn *c) { return dkf_fabric_fd(&c->eq->fid); }
int dkf_conn_cq_fd(struct dkf_conn *c) { return dkf_fabric_fd(&c->cq->fid); }

/* Connection events: 1 connected, 2 shut down by the peer (or refused), -FI_EAGAIN nothing. */
int dkf_conn_poll_cm(struct dkf_conn *c)
{
	uint8_t buf[sizeof(struct fi_eq_cm_entry) + 64];
	uint32_t event;
	for (;;) {
		ssize_t n = fi_eq_read(c->eq, &event, buf, sizeof buf, 0);
		if (n == -FI_EAVAIL) {
			struct fi_eq_err_entry err = {0};
			fi_eq_readerr(c->eq, &err, 0);
			c->shut = 1;
			return 2;
		}
		if (n < 0)
			return (int)n;
		if (event == FI_CONNECTED)
			c->connected = 1;
		else if (event == FI_SHUTDOWN)
			c->shut = 1;
		else
			continue;
		return c->shut ? 2 : 1;
	}
}

/* 0: nothing is pending, the caller may wait on the queues' descriptors; -FI_EAGAIN: poll the
 * queues again first. */
int dkf_conn_trywait(struct dkf_conn *c)
{
	struct fid *fids[2] = {&c->cq->fid, &c->eq->fid};
	return fi_trywait(c->fab->fabric, fids, 2);
}

uint8_t *dkf_conn_buf(struct dkf_conn *c, size_t i) { return c->mem + i * c->bufsize; }

/* Posts receive buffer i (0 <= i < nbufs) again. */
int dkf_conn_post_recv(struct dkf_conn *c, size_t i)
{
	return (int)fi_recv(c->ep, c->mem + i * c->bufsize, c->bufsize, c->desc, 0, &c->ctx[i]);
}

/* Sends the first len bytes of send buffer i (0 <= i < nbufs). */
int dkf_conn_send(struct dkf_conn *c, size_t i, size_t len)
{
	size_t at = c->nbufs + i;
	return (int)fi_send(c->ep, c->mem + at * c->bufsize, len, c->desc, 0, &c->ctx[at]);
}

/* Whether p is one of the connection's operation contexts (every completion names one). */
static int in_ctx(struct dkf_conn *c, void *p)
{
	uintptr_t a = (uintptr_t)p, lo = (uintptr_t)c->ctx, hi = (uintptr_t)(c->ctx + 2 * c->nbufs);
	return a >= lo && a < hi && (a - lo) % sizeof *c->ctx == 0;
}

/* Up to max completions into out: their count, or -FI_EAGAIN if none. A failed operation
 * (the connection broke: flushed receives, refused sends) is a completion with `error` set. */
int dkf_conn_poll_cq(struct dkf_conn *c, struct dkf_completion *out, size_t max)
{
	struct fi_cq_msg_entry e[16];
	if (max > 16)
		max = 16;
	ssize_t n = fi_cq_read(c->cq, e, max);
	if (n == -FI_EAVAIL) {
		struct fi_cq_err_entry err = {0};
		if (fi_cq_readerr(c->cq, &err, 0) != 1)
			return -FI_EOTHER;
		if (!in_ctx(c, err.op_context))
			return -FI_EOTHER;
		size_t at = (struct fi_context2 *)err.op_context - c->ctx;
		out[0].index = at < c->nbufs ? at : at - c->nbufs;
		out[0].recv = at < c->nbufs;
		out[0].len = 0;
		out[0].error = -(err.err ? err.err : FI_EOTHER);
		return 1;
	}
	if (n < 0)
		return (int)n;
	for (ssize_t k = 0; k < n; k++) {
		if (!in_ctx(c, e[k].op_context))
			return -FI_EOTHER;
		size_t at = (struct fi_context2 *)e[k].op_context - c->ctx;
		out[k].index = at < c->nbufs ? at : at - c->nbufs;
		out[k].recv = at < c->nbufs;
		out[k].len = e[k].len;
		out[k].error = 0;
	}
	return (int)n;
}

void dkf_conn_shutdown(struct dkf_conn *c)
{
	if (c->connected && !c->shut)
		fi_shutdown(c->ep, 0);
	c->shut = 1;
}

void dkf_conn_close(struct dkf_conn *c) { conn_free(c); }
