/* moetier wire fast path: a decode RUN, client and worker, without Python in the loop.
 *
 * moetier/transport/protocol.py is the format, and the judge of every
 * message. This file handles only the one message the decode loop sends per
 * MoE layer — a RUN of one row whose tensors all ride in the header frame —
 * and its reply; everything else (other commands, prefill, any field outside
 * the fast shape, any error) is handed to Python untouched, which decodes it
 * and answers exactly as it always does. So the fast path never refuses
 * anything itself: it either serves a message Python would accept, with the
 * bytes Python would send, or it defers.
 *
 * Frame 0 of every message (protocol.py draws it):
 *     u32 little-endian H | H bytes of msgpack header | tensors under 64 KiB, each at a multiple of 8
 *
 * Worker: `wire_serve` receives on the worker's ROUTER socket (pyzmq's own
 * libzmq handle), serves fast RUNs of admitted sessions with the native
 * decode kernel (backends/cpu_kernels.c's moe_decode on the backend's thread
 * pool, both passed in as pointers: the same function, the same arguments,
 * hence the same bits as the Python path through TorchBackend, for experts in
 * any stored format the kernel reads), and returns to Python for anything else, when
 * idle, or after a batch. Client: `wire_send_run` encodes and sends a RUN,
 * `wire_recv_reply` takes the next message and, if it is the awaited RUN
 * reply, copies y out; otherwise the frames wait in the client's inbox for
 * Python. libzmq is the copy pyzmq loaded (this library links that file).
 * ctypes releases the GIL around every call here.
 */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* -- libzmq (the ABI of 4.x; declared here so no zmq.h is needed) -------------------------------- */
typedef struct { unsigned char _[64]; } zmq_msg_t;
int zmq_msg_init(zmq_msg_t *msg);
int zmq_msg_recv(zmq_msg_t *msg, void *socket, int flags);
int zmq_msg_send(zmq_msg_t *msg, void *socket, int flags);
int zmq_msg_close(zmq_msg_t *msg);
int zmq_msg_more(const zmq_msg_t *msg);
void *zmq_msg_data(zmq_msg_t *msg);
size_t zmq_msg_size(const zmq_msg_t *msg);
const char *zmq_msg_gets(const zmq_msg_t *msg, const char *property);
int zmq_send(void *socket, const void *buf, size_t len, int flags);
int zmq_errno(void);
typedef struct { void *socket; int fd; short events; short revents; } zmq_pollitem_t;
int zmq_poll(zmq_pollitem_t *items, int nitems, long timeout_ms);
#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_POLLIN 1

/* -- the protocol's constants (tests check them against protocol.py) -------------------------------- */
#define PROTOCOL_VERSION 2
#define MAX_HEADER_BYTES 65536
#define INLINE_MAX_BYTES 65536 /* tensors smaller than this ride in frame 0 */
#define MAX_DIM 2147483647LL
#define CMD_RUN 3
#define CMD_PING 4
#define MAX_FRAMES 64   /* a message with more parts is dropped */
#define MAX_PICKS 1024  /* experts of one fast RUN */

enum { F32, BF16, F16, I32, I64, U8, N_DTYPES };
static const char *const DTYPE_NAME[N_DTYPES] = {"f32", "bf16", "f16", "i32", "i64", "u8"};
static const int64_t ITEMSIZE[N_DTYPES] = {4, 2, 2, 4, 8, 1};

int64_t wire_constant(int64_t which) {
    const int64_t values[] = {PROTOCOL_VERSION, MAX_HEADER_BYTES, INLINE_MAX_BYTES, MAX_DIM, CMD_RUN, CMD_PING, MAX_PICKS};
    return which >= 0 && which < (int64_t)(sizeof values / sizeof *values) ? values[which] : -1;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int64_t align8(int64_t n) { return (n + 7) & ~(int64_t)7; }

/* Between polls the waiting thread yields: on a machine with few cores this process's own ZeroMQ I/O
 * thread, which must run to hand the reply over, may be queued on this core, and a spinning thread that
 * slept before (the scheduler's sleeper credit) is not preempted for it until the next tick (1-4 ms). */
static inline void cpu_relax(void) { sched_yield(); }

/* Wait until `socket` has a message: poll for up to spin_s first (a message due in microseconds then
 * costs no wake-up), then sleep up to timeout_ms. -> > 0 readable, 0 not (or an error). */
static int wait_readable(void *socket, double spin_s, long timeout_ms) {
    zmq_pollitem_t item = {socket, 0, ZMQ_POLLIN, 0};
    int ready = zmq_poll(&item, 1, 0);
    if (ready == 0 && spin_s > 0) {
        const double until = now_s() + spin_s;
        while ((ready = zmq_poll(&item, 1, 0)) == 0 && now_s() < until) cpu_relax();
    }
    if (ready == 0) ready = zmq_poll(&item, 1, timeout_ms);
    return ready;
}

/* -- msgpack, the subset a header uses ------------------------------------------------------------- */
/* Reading: each function consumes one value of its kind or returns 0 (anything else: the caller defers). */
typedef struct { const uint8_t *p, *end; } cursor;

static int take(cursor *c, int64_t n, const uint8_t **out) {
    if (c->end - c->p < n) return 0;
    *out = c->p;
    c->p += n;
    return 1;
}

static uint64_t big_endian(const uint8_t *b, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | b[i];
    return v;
}

/* a non-negative integer in any encoding (msgpack may write a small one as a signed type) */
static int read_uint(cursor *c, uint64_t *v) {
    const uint8_t *b;
    if (!take(c, 1, &b)) return 0;
    const uint8_t tag = b[0];
    if (tag <= 0x7f) { *v = tag; return 1; }
    int n = 0, is_signed = 0;
    switch (tag) {
        case 0xcc: n = 1; break; case 0xcd: n = 2; break; case 0xce: n = 4; break; case 0xcf: n = 8; break;
        case 0xd0: n = 1; is_signed = 1; break; case 0xd1: n = 2; is_signed = 1; break;
        case 0xd2: n = 4; is_signed = 1; break; case 0xd3: n = 8; is_signed = 1; break;
        default: return 0;
    }
    if (!take(c, n, &b)) return 0;
    *v = big_endian(b, n);
    if (is_signed && (*v >> (8 * n - 1)) & 1) return 0; /* negative */
    return 1;
}

/* an integer in [0, hi] */
static int read_int(cursor *c, int64_t hi, int64_t *v) {
    uint64_t u;
    if (!read_uint(c, &u) || u > (uint64_t)hi) return 0;
    *v = (int64_t)u;
    return 1;
}

/* a finite number (integer or float), as protocol.py's _float takes it */
static int read_number(cursor *c, double *v) {
    const uint8_t *b;
    if (c->p >= c->end) return 0;
    if (*c->p == 0xcb || *c->p == 0xca) {
        const int n = *c->p == 0xcb ? 8 : 4;
        c->p++;
        if (!take(c, n, &b)) return 0;
        const uint64_t bits = big_endian(b, n);
        if (n == 8) { double d; memcpy(&d, &bits, 8); *v = d; }
        else { const uint32_t u = (uint32_t)bits; float f; memcpy(&f, &u, 4); *v = f; }
        return isfinite(*v);
    }
    uint64_t u;
    if (!read_uint(c, &u)) return 0; /* negative integers defer: a compute time is never one */
    *v = (double)u;
    return 1;
}

static int read_head(cursor *c, uint8_t fix, uint8_t fix_mask, uint8_t tag16, uint8_t tag32, uint32_t *n) {
    const uint8_t *b;
    if (!take(c, 1, &b)) return 0;
    if ((b[0] & fix_mask) == fix) { *n = b[0] & (uint8_t)~fix_mask; return 1; }
    const int bytes = b[0] == tag16 ? 2 : b[0] == tag32 ? 4 : 0;
    if (!bytes || !take(c, bytes, &b)) return 0;
    *n = (uint32_t)big_endian(b, bytes);
    return 1;
}

static int read_map(cursor *c, uint32_t *n) { return read_head(c, 0x80, 0xf0, 0xde, 0xdf, n); }
static int read_array(cursor *c, uint32_t *n) { return read_head(c, 0x90, 0xf0, 0xdc, 0xdd, n); }

static int read_str(cursor *c, const char **s, uint32_t *n) {
    const uint8_t *b;
    if (c->p >= c->end) return 0;
    if (*c->p == 0xd9) { /* str8 */
        c->p++;
        if (!take(c, 1, &b)) return 0;
        *n = b[0];
    } else if (!read_head(c, 0xa0, 0xe0, 0xda, 0xdb, n)) {
        return 0;
    }
    if (!take(c, *n, &b)) return 0;
    *s = (const char *)b;
    return 1;
}

static int is(const char *s, uint32_t n, const char *name) { return strlen(name) == n && memcmp(s, name, n) == 0; }

static int read_dtype(cursor *c, int *dtype) {
    const char *s;
    uint32_t n;
    if (!read_str(c, &s, &n)) return 0;
    for (int d = 0; d < N_DTYPES; d++)
        if (is(s, n, DTYPE_NAME[d])) { *dtype = d; return 1; }
    return 0;
}

/* a list of at most `cap` integers in [0, MAX_DIM] */
static int read_ints(cursor *c, int64_t *out, uint32_t cap, uint32_t *n) {
    if (!read_array(c, n) || *n > cap) return 0;
    for (uint32_t i = 0; i < *n; i++)
        if (!read_int(c, MAX_DIM, &out[i])) return 0;
    return 1;
}

/* Writing: the caller reserves room (a header here is at most a few KiB). */
typedef struct { uint8_t *p; } writer;

static void put_be(writer *w, uint8_t tag, uint64_t v, int n) {
    *w->p++ = tag;
    for (int i = n - 1; i >= 0; i--) *w->p++ = (uint8_t)(v >> (8 * i));
}

static void put_uint(writer *w, uint64_t v) { /* the smallest encoding, as msgpack-python writes */
    if (v <= 0x7f) *w->p++ = (uint8_t)v;
    else if (v <= 0xff) put_be(w, 0xcc, v, 1);
    else if (v <= 0xffff) put_be(w, 0xcd, v, 2);
    else if (v <= 0xffffffffu) put_be(w, 0xce, v, 4);
    else put_be(w, 0xcf, v, 8);
}

static void put_double(writer *w, double d) {
    uint64_t bits;
    memcpy(&bits, &d, 8);
    put_be(w, 0xcb, bits, 8);
}

static void put_str(writer *w, const char *s) { /* short ASCII keys and dtype names */
    const size_t n = strlen(s);
    *w->p++ = (uint8_t)(0xa0 | n);
    memcpy(w->p, s, n);
    w->p += n;
}

static void put_array(writer *w, uint32_t n) { if (n < 16) *w->p++ = (uint8_t)(0x90 | n); else put_be(w, 0xdc, n, 2); }
static void put_map(writer *w, uint32_t n) { *w->p++ = (uint8_t)(0x80 | n); }

static void put_descriptor(writer *w, int dtype, const int64_t *dims, int ndim) {
    put_array(w, 2);
    put_str(w, DTYPE_NAME[dtype]);
    put_array(w, (uint32_t)ndim);
    for (int i = 0; i < ndim; i++) put_uint(w, (uint64_t)dims[i]);
}

/* -- frames ---------------------------------------------------------------------------------------------- */
/* A growable byte buffer that a message is built in before one zmq_send copies it out. */
typedef struct { uint8_t *data; int64_t cap; } buffer;

static int reserve(buffer *b, int64_t n) {
    if (n <= b->cap) return 1;
    uint8_t *grown = realloc(b->data, (size_t)n);
    if (!grown) return 0;
    b->data = grown;
    b->cap = n;
    return 1;
}

/* The parts of one received message. */
typedef struct { zmq_msg_t parts[MAX_FRAMES]; int64_t count; } inbox;

static void inbox_clear(inbox *in) {
    for (int64_t i = 0; i < in->count; i++) zmq_msg_close(&in->parts[i]);
    in->count = 0;
}

/* Receive one whole message (the first part with `flags`, the rest at once: ZeroMQ delivers a message whole).
 * -> parts, 0 if none is there, -1 if it had more than MAX_FRAMES parts (dropped). */
static int64_t inbox_recv(inbox *in, void *socket, int flags) {
    inbox_clear(in);
    zmq_msg_init(&in->parts[0]);
    if (zmq_msg_recv(&in->parts[0], socket, flags) < 0) {
        zmq_msg_close(&in->parts[0]);
        return 0;
    }
    in->count = 1;
    while (zmq_msg_more(&in->parts[in->count - 1])) {
        if (in->count == MAX_FRAMES) { /* drain and drop */
            zmq_msg_t rest;
            int more = 1;
            while (more) {
                zmq_msg_init(&rest);
                if (zmq_msg_recv(&rest, socket, 0) < 0) more = 0;
                else more = zmq_msg_more(&rest);
                zmq_msg_close(&rest);
            }
            inbox_clear(in);
            return -1;
        }
        zmq_msg_init(&in->parts[in->count]);
        if (zmq_msg_recv(&in->parts[in->count], socket, 0) < 0) { zmq_msg_close(&in->parts[in->count]); break; }
        in->count++;
    }
    return in->count;
}

/* Python's view of an inbox: how many parts, and each one's bytes (valid until the next receive). */
int64_t wire_inbox_count(const inbox *in) { return in->count; }
const void *wire_inbox_part(inbox *in, int64_t i, int64_t *size) {
    *size = (int64_t)zmq_msg_size(&in->parts[i]);
    return zmq_msg_data(&in->parts[i]);
}
const char *wire_inbox_peer(const inbox *in, int64_t i) {
    return i < in->count ? zmq_msg_gets(&in->parts[i], "Peer-Address") : NULL;
}

/* Frame 0 of a fast message: its header as a cursor, the frame's bytes after it. */
static int open_frame(const uint8_t *frame, int64_t size, cursor *header) {
    if (size < 4) return 0;
    const int64_t h = (int64_t)frame[0] | (int64_t)frame[1] << 8 | (int64_t)frame[2] << 16 | (int64_t)frame[3] << 24;
    if (h > MAX_HEADER_BYTES || 4 + h > size) return 0;
    header->p = frame + 4;
    header->end = frame + 4 + h;
    return 1;
}

/* A tensor's descriptor, read: [dtype, [d0] or [d0, d1]]; 0 if it is anything else, or its bytes reach
 * `limit` or INLINE_MAX_BYTES (such a tensor is not the fast path's). */
typedef struct { int dtype, ndim; int64_t dims[2]; int64_t nbytes; } tensor_desc;

static int read_descriptor(cursor *c, int64_t limit, tensor_desc *t) {
    uint32_t n, ndim;
    if (!read_array(c, &n) || n != 2 || !read_dtype(c, &t->dtype)) return 0;
    if (!read_ints(c, t->dims, 2, &ndim) || ndim == 0) return 0;
    t->ndim = (int)ndim;
    t->nbytes = ITEMSIZE[t->dtype];
    for (uint32_t i = 0; i < ndim; i++) {
        if (t->dims[i] && t->nbytes > limit / t->dims[i]) return 0;
        t->nbytes *= t->dims[i];
    }
    return t->nbytes < INLINE_MAX_BYTES;
}

/* Place inline tensors after the header: their offsets, and whether the frame ends exactly after the last. */
static int lay_out(int64_t header_end, const tensor_desc *t, int n, int64_t *offset, int64_t frame_size) {
    int64_t at = header_end;
    for (int i = 0; i < n; i++) {
        at = align8(at);
        offset[i] = at;
        at += t[i].nbytes;
    }
    return at == frame_size;
}

/* A header as the fast path reads it: every key it knows, which ones it saw, and where each tensor sits.
 * Anything else — an unknown key, a key twice, a value of another kind, a tensor not inline, a frame
 * whose length is not exactly header + tensors — and the message is Python's. */
enum { K_V = 1, K_C = 2, K_ID = 4, K_LAYER = 8, K_EXPERTS = 16, K_COUNTS = 32, K_COMPUTE = 64, K_T = 128 };
#define RUN_KEYS (K_V | K_C | K_ID | K_LAYER | K_EXPERTS | K_COUNTS | K_T)
#define RUN_REPLY_KEYS (K_V | K_C | K_ID | K_COMPUTE | K_T)
#define PING_KEYS (K_V | K_C | K_ID | K_T)

typedef struct {
    uint32_t seen;
    int64_t version, command, layer, m, ncounts;
    uint64_t id;
    double compute_us;
    int64_t experts[MAX_PICKS], counts[MAX_PICKS];
    int64_t nt;
    tensor_desc t[3];
    int64_t offset[3];
} header;

static int parse_header(const uint8_t *frame, int64_t size, int64_t limit, header *h) {
    cursor c;
    uint32_t keys, n;
    h->seen = 0;
    h->nt = 0;
    if (!open_frame(frame, size, &c) || !read_map(&c, &keys) || keys > 8) return 0;
    for (uint32_t k = 0; k < keys; k++) {
        const char *key;
        uint32_t len, bit;
        int ok;
        if (!read_str(&c, &key, &len)) return 0;
        if (is(key, len, "v")) { bit = K_V; ok = read_int(&c, MAX_DIM, &h->version); }
        else if (is(key, len, "c")) { bit = K_C; ok = read_int(&c, MAX_DIM, &h->command); }
        else if (is(key, len, "id")) { bit = K_ID; ok = read_uint(&c, &h->id); }
        else if (is(key, len, "layer")) { bit = K_LAYER; ok = read_int(&c, MAX_DIM, &h->layer); }
        else if (is(key, len, "experts")) { bit = K_EXPERTS; ok = read_ints(&c, h->experts, MAX_PICKS, &n); h->m = n; }
        else if (is(key, len, "counts")) { bit = K_COUNTS; ok = read_ints(&c, h->counts, MAX_PICKS, &n); h->ncounts = n; }
        else if (is(key, len, "compute_us")) { bit = K_COMPUTE; ok = read_number(&c, &h->compute_us); }
        else if (is(key, len, "t")) {
            bit = K_T;
            ok = read_array(&c, &n) && n >= 1 && n <= 3;
            int64_t total = 0;
            for (uint32_t i = 0; ok && i < n; i++) {
                ok = read_descriptor(&c, limit, &h->t[i]);
                total += h->t[i].nbytes;
            }
            ok = ok && total <= limit;
            h->nt = n;
        } else {
            return 0; /* a key the fast path does not know */
        }
        if (!ok || (h->seen & bit)) return 0;
        h->seen |= bit;
    }
    if (c.p != c.end || h->version != PROTOCOL_VERSION || !(h->seen & K_T)) return 0;
    return lay_out(c.end - frame, h->t, (int)h->nt, h->offset, size);
}

static int is_tensor(const header *h, int i, int dtype, int ndim) { return h->t[i].dtype == dtype && h->t[i].ndim == ndim; }

/* Frame 0 of a RUN that protocol.decode_request accepts with these fields, all three tensors inline.
 * -> 1 parsed, 0 defer (not necessarily bad: Python decides). */
int64_t wire_parse_run(const uint8_t *frame, int64_t size, int64_t limit, header *h) {
    if (!parse_header(frame, size, limit, h) || h->seen != RUN_KEYS || h->command != CMD_RUN || h->nt != 3) return 0;
    if (h->ncounts != h->m || h->t[0].ndim != 2 || h->t[0].dtype > F16) return 0;
    if (!(is_tensor(h, 1, I32, 1) || is_tensor(h, 1, I64, 1)) || !is_tensor(h, 2, F32, 1)) return 0;
    int64_t total = 0;
    for (int64_t i = 0; i < h->m; i++) total += h->counts[i];
    return total == h->t[1].dims[0] && total == h->t[2].dims[0];
}

/* Frame 0 of a PING (request or reply: the same message) with its payload inline. */
int64_t wire_parse_ping(const uint8_t *frame, int64_t size, int64_t limit, header *h) {
    return parse_header(frame, size, limit, h) && h->seen == PING_KEYS && h->command == CMD_PING && h->nt == 1 &&
           is_tensor(h, 0, U8, 1);
}

/* Frame 0 is built in a buffer: the length prefix, the header (writer from byte 4), then tensors. */
static writer header_writer(buffer *b) { return (writer){b->data + 4}; }

/* Close the header: write its length in front; -> where it ends. */
static int64_t end_header(buffer *b, writer w) {
    const int64_t h = (w.p - b->data) - 4;
    for (int i = 0; i < 4; i++) b->data[i] = (uint8_t)(h >> (8 * i));
    return 4 + h;
}

/* Put a tensor's bytes at the next multiple of 8 from `at`, zeros in the gap; -> where it ends. */
static int64_t put_tensor(buffer *b, int64_t at, const void *data, int64_t nbytes) {
    const int64_t start = align8(at);
    memset(b->data + at, 0, (size_t)(start - at));
    if (nbytes) memcpy(b->data + start, data, (size_t)nbytes);
    return start + nbytes;
}

/* -- numbers ------------------------------------------------------------------------------------------------ */
static float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN -> 0x7fc0: torch's c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* ================================================================================================ */
/* Worker                                                                                              */
/* ================================================================================================ */
/* cpu_kernels.c's moe_decode on its pool (experts: RECORD_WORDS k int64s, a record per expert) -> 0, or < 0 */
typedef int64_t (*decode_fn)(void *pool, const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                             const float *scale, float *out);
enum { RECORD_WORDS = 5 };

/* an expert the kernel reads in place: its record (gate_up [2I, D] and down [D, I] addresses, their GGML
 * types, flags; cpu_kernels.expert_record checked it) and I */
typedef struct { int64_t record[RECORD_WORDS], inter; } native_expert;

typedef struct {
    uint8_t identity[256];
    int64_t size;
    int64_t runs;    /* RUNs served here */
    int64_t active;  /* the worker's message count at its last message */
} session;

typedef struct {
    inbox in;  /* the last message Python must handle: identity, frame 0, ... */
    decode_fn decode;
    void *pool;      /* the kernel's thread pool, decode's first argument */
    int64_t hidden, layers, experts, max_message_bytes;
    native_expert *table;  /* [layers * experts]; inter == -1: not held here */
    int64_t *seen;         /* [experts] stamps: an expert twice in one RUN */
    int64_t stamp;
    session *sessions;
    int64_t n_sessions, max_sessions;
    int64_t messages, fast_runs, pings, dropped;
    buffer reply;
    float *scratch;  /* x [D], out [D] */
    header parsed;   /* the message being served (~16 KiB: kept here, not allocated per call) */
} worker;

worker *wire_worker_open(int64_t hidden, int64_t layers, int64_t experts, int64_t max_message_bytes, int64_t max_sessions,
                         void *decode, void *pool) {
    worker *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->decode = (decode_fn)decode;
    w->pool = pool;
    w->hidden = hidden;
    w->layers = layers;
    w->experts = experts;
    w->max_message_bytes = max_message_bytes;
    w->max_sessions = max_sessions;
    w->table = malloc(sizeof *w->table * (size_t)(layers * experts));
    w->seen = calloc((size_t)experts, sizeof *w->seen);
    w->sessions = calloc((size_t)max_sessions, sizeof *w->sessions);
    w->scratch = malloc(sizeof(float) * (size_t)(2 * hidden));
    if (!w->table || !w->seen || !w->sessions || !w->scratch) {
        free(w->table); free(w->seen); free(w->sessions); free(w->scratch); free(w);
        return NULL;
    }
    for (int64_t i = 0; i < layers * experts; i++) w->table[i].inter = -1;
    return w;
}

void wire_worker_close(worker *w) {
    if (!w) return;
    inbox_clear(&w->in);
    free(w->table); free(w->seen); free(w->sessions); free(w->reply.data); free(w->scratch); free(w);
}

inbox *wire_worker_inbox(worker *w) { return &w->in; }

/* An expert the worker holds, which the fast path may compute: record, RECORD_WORDS int64s (cpu_kernels.expert_record). */
void wire_worker_expert(worker *w, int64_t layer, int64_t expert, const int64_t *record, int64_t inter) {
    if (layer >= 0 && layer < w->layers && expert >= 0 && expert < w->experts) {
        native_expert *e = &w->table[layer * w->experts + expert];
        memcpy(e->record, record, sizeof e->record);
        e->inter = inter;
    }
}

static session *find_session(worker *w, const uint8_t *identity, int64_t size) {
    for (int64_t i = 0; i < w->n_sessions; i++)
        if (w->sessions[i].size == size && memcmp(w->sessions[i].identity, identity, (size_t)size) == 0) return &w->sessions[i];
    return NULL;
}

/* Sessions mirror the worker's (Python admits and closes them): -> 1 done, 0 no room or bad identity. */
int64_t wire_session_open(worker *w, const uint8_t *identity, int64_t size) {
    if (size < 0 || size > 256) return 0;
    session *s = find_session(w, identity, size);
    if (!s) {
        if (w->n_sessions == w->max_sessions) return 0;
        s = &w->sessions[w->n_sessions++];
        memcpy(s->identity, identity, (size_t)size);
        s->size = size;
    }
    s->runs = 0;
    s->active = w->messages;
    return 1;
}

void wire_session_close(worker *w, const uint8_t *identity, int64_t size) {
    session *s = find_session(w, identity, size);
    if (s) *s = w->sessions[--w->n_sessions];
}

/* A session's RUNs served here and its last activity (-1, -1 if unknown). */
void wire_session_activity(worker *w, const uint8_t *identity, int64_t size, int64_t *runs, int64_t *active) {
    session *s = find_session(w, identity, size);
    *runs = s ? s->runs : -1;
    *active = s ? s->active : -1;
}

/* worker counters: messages received, RUNs and PINGs served here, messages dropped (too many parts) */
void wire_worker_counts(const worker *w, int64_t *out) {
    out[0] = w->messages;
    out[1] = w->fast_runs;
    out[2] = w->pings;
    out[3] = w->dropped;
}

/* Serve a parsed RUN if it has the decode shape and every expert is held in native form; -> 1 replied, 0 defer. */
static int serve_run(worker *w, void *router, const zmq_msg_t *identity, const uint8_t *frame, const header *r) {
    const tensor_desc *x = &r->t[0];
    if (x->dims[0] != 1 || x->dims[1] != w->hidden || x->dtype == F16 || r->layer >= w->layers || r->m == 0) return 0;
    const int64_t D = w->hidden, k = r->m;
    const uint8_t *rows = frame + r->offset[1];
    int64_t records[RECORD_WORDS * MAX_PICKS];
    float scales[MAX_PICKS];
    int64_t inter = -1;
    w->stamp++;
    for (int64_t j = 0; j < k; j++) {
        if (r->counts[j] != 1 || r->experts[j] >= w->experts) return 0;  /* one row per expert */
        int64_t row;                                                     /* ... and it is row 0 */
        if (r->t[1].dtype == I32) { int32_t v; memcpy(&v, rows + 4 * j, 4); row = v; }
        else memcpy(&row, rows + 8 * j, 8);
        if (row != 0) return 0;
        const native_expert *e = &w->table[r->layer * w->experts + r->experts[j]];
        if (e->inter < 0 || (inter >= 0 && e->inter != inter) || w->seen[r->experts[j]] == w->stamp) return 0;
        w->seen[r->experts[j]] = w->stamp;
        inter = e->inter;
        memcpy(&records[RECORD_WORDS * j], e->record, sizeof e->record);
        memcpy(&scales[j], frame + r->offset[2] + 4 * j, 4);
    }
    const double begin = now_s();
    float *xf = w->scratch, *out = w->scratch + D;
    const uint8_t *xb = frame + r->offset[0];
    if (x->dtype == F32) memcpy(xf, xb, sizeof(float) * (size_t)D);
    else for (int64_t d = 0; d < D; d++) { uint16_t h; memcpy(&h, xb + 2 * d, 2); xf[d] = bf16_to_f32(h); }
    if (w->decode(w->pool, xf, D, inter, k, records, scales, out) != 0) return 0;  /* out of memory: Python answers */
    const double compute_us = (now_s() - begin) * 1e6;

    /* reply: {"v", "c", "id", "compute_us", "t": [[dtype, [1, D]]]} then y in x's dtype */
    const int64_t y_bytes = D * ITEMSIZE[x->dtype], dims[2] = {1, D};
    if (!reserve(&w->reply, 4 + 128 + 8 + y_bytes)) return 0;
    writer h = header_writer(&w->reply);
    put_map(&h, 5);
    put_str(&h, "v"); put_uint(&h, PROTOCOL_VERSION);
    put_str(&h, "c"); put_uint(&h, CMD_RUN);
    put_str(&h, "id"); put_uint(&h, r->id);
    put_str(&h, "compute_us"); put_double(&h, compute_us);
    put_str(&h, "t"); put_array(&h, 1); put_descriptor(&h, x->dtype, dims, 2);
    if (x->dtype == BF16) /* in place: y's bf16 values take the first half of out's bytes */
        for (int64_t d = 0; d < D; d++) { const uint16_t b = f32_to_bf16(out[d]); memcpy((uint8_t *)out + 2 * d, &b, 2); }
    const int64_t end = put_tensor(&w->reply, end_header(&w->reply, h), out, y_bytes);
    zmq_send(router, zmq_msg_data((zmq_msg_t *)identity), zmq_msg_size(identity), ZMQ_SNDMORE);
    zmq_send(router, w->reply.data, (size_t)end, 0); /* ROUTER drops it if the peer is gone */
    return 1;
}

/* Receive and serve on `router` until a message needs Python (-> 1: identity, frames in the inbox), none
 * came within timeout_ms (-> 0), or `batch` messages were served (-> 2, so the caller can look at its stop
 * flag and socket events now and then). Served here: a PING from anyone (echoed: the reply is the same
 * message), a decode RUN of an admitted session. The worker sleeps between messages: polling for the next
 * one, as the client does for its reply, measured p50 -5 us and p99 +31 us on a 2-core machine both ends
 * shared. */
int64_t wire_serve(worker *w, void *router, int64_t batch, int64_t timeout_ms) {
    header *h = &w->parsed;
    int64_t served = 0, status = 2;
    while (served < batch) {
        const int64_t parts = wait_readable(router, 0, (long)timeout_ms) > 0 ? inbox_recv(&w->in, router, ZMQ_DONTWAIT) : 0;
        if (parts == 0) { status = 0; break; }
        w->messages++;
        if (parts < 0) { w->dropped++; served++; continue; } /* counted: a flood of them still lets the caller look at its stop flag */
        zmq_msg_t *identity = &w->in.parts[0];
        session *s = parts >= 2 ? find_session(w, zmq_msg_data(identity), (int64_t)zmq_msg_size(identity)) : NULL;
        if (s) s->active = w->messages;
        const uint8_t *frame = parts == 2 ? zmq_msg_data(&w->in.parts[1]) : NULL;
        const int64_t size = frame ? (int64_t)zmq_msg_size(&w->in.parts[1]) : 0;
        if (frame && wire_parse_ping(frame, size, w->max_message_bytes, h)) {
            zmq_msg_send(identity, router, ZMQ_SNDMORE); /* both parts go back as they came (a sent part is left */
            zmq_msg_send(&w->in.parts[1], router, 0);   /* empty, so the inbox's close is harmless) */
            w->pings++;
        } else if (s && frame && wire_parse_run(frame, size, w->max_message_bytes, h) && serve_run(w, router, identity, frame, h)) {
            s->runs++;
            w->fast_runs++;
        } else {
            status = 1; /* Python's */
            break;
        }
        served++;
        inbox_clear(&w->in);
    }
    return status;
}

/* ================================================================================================ */
/* Client                                                                                              */
/* ================================================================================================ */
typedef struct {
    inbox in;  /* a message `wire_recv_reply` did not take */
    buffer out;
    int64_t max_message_bytes;
} client;

client *wire_client_open(int64_t max_message_bytes) {
    client *c = calloc(1, sizeof *c);
    if (c) c->max_message_bytes = max_message_bytes;
    return c;
}

void wire_client_close(client *c) {
    if (!c) return;
    inbox_clear(&c->in);
    free(c->out.data);
    free(c);
}

inbox *wire_client_inbox(client *c) { return &c->in; }

/* Encode and send a RUN whose tensors are all inline (the caller checks): x [n, D], rows [r], weights [r] f32.
 * -> 0 sent, else zmq's errno (EAGAIN: the socket would block). */
int64_t wire_send_run(client *c, void *socket, uint64_t id, int64_t layer, int64_t m, const int64_t *experts,
                      const int64_t *counts, const void *x, int64_t x_dtype, int64_t n, int64_t D, const void *rows,
                      int64_t rows_dtype, int64_t r, const void *weights, int64_t flags) {
    const int64_t x_dims[2] = {n, D}, r_dims[1] = {r};
    const int64_t bytes[3] = {n * D * ITEMSIZE[x_dtype], r * ITEMSIZE[rows_dtype], 4 * r};
    const void *data[3] = {x, rows, weights};
    if (!reserve(&c->out, 4 + 128 + 20 * m + 3 * 8 + bytes[0] + bytes[1] + bytes[2])) return 12; /* ENOMEM */
    writer h = header_writer(&c->out);
    put_map(&h, 7);
    put_str(&h, "layer"); put_uint(&h, (uint64_t)layer);
    put_str(&h, "experts"); put_array(&h, (uint32_t)m);
    for (int64_t j = 0; j < m; j++) put_uint(&h, (uint64_t)experts[j]);
    put_str(&h, "counts"); put_array(&h, (uint32_t)m);
    for (int64_t j = 0; j < m; j++) put_uint(&h, (uint64_t)counts[j]);
    put_str(&h, "v"); put_uint(&h, PROTOCOL_VERSION);
    put_str(&h, "c"); put_uint(&h, CMD_RUN);
    put_str(&h, "id"); put_uint(&h, id);
    put_str(&h, "t"); put_array(&h, 3);
    put_descriptor(&h, (int)x_dtype, x_dims, 2);
    put_descriptor(&h, (int)rows_dtype, r_dims, 1);
    put_descriptor(&h, F32, r_dims, 1);
    int64_t at = end_header(&c->out, h);
    for (int i = 0; i < 3; i++) at = put_tensor(&c->out, at, data[i], bytes[i]);
    return zmq_send(socket, c->out.data, (size_t)at, (int)flags) < 0 ? zmq_errno() : 0;
}

/* Encode and send a PING of an inline payload [n] u8. -> 0 sent, else zmq's errno. */
int64_t wire_send_ping(client *c, void *socket, uint64_t id, const void *payload, int64_t n, int64_t flags) {
    const int64_t dims[1] = {n};
    if (!reserve(&c->out, 4 + 64 + 8 + n)) return 12; /* ENOMEM */
    writer h = header_writer(&c->out);
    put_map(&h, 4);
    put_str(&h, "v"); put_uint(&h, PROTOCOL_VERSION);
    put_str(&h, "c"); put_uint(&h, CMD_PING);
    put_str(&h, "id"); put_uint(&h, id);
    put_str(&h, "t"); put_array(&h, 1); put_descriptor(&h, U8, dims, 1);
    const int64_t end = put_tensor(&c->out, end_header(&c->out, h), payload, n);
    return zmq_send(socket, c->out.data, (size_t)end, (int)flags) < 0 ? zmq_errno() : 0;
}

/* Wait up to timeout_ms for a message, polling the first spin_s of it before sleeping (a reply due in
 * microseconds then costs no wake-up). -> 0 none; 1 the reply of `want_id` to command `want` (RUN or PING)
 * with its one tensor of `y_dtype` and y_dims (ndim 2: [n, D], ndim 1: [n]) copied to y, a RUN's compute
 * time in *compute_us; 2 another message, in the inbox for Python; 3 one dropped (too many parts). */
int64_t wire_recv_reply(client *c, void *socket, int64_t timeout_ms, double spin_s, uint64_t want_id, int64_t want, void *y,
                        int64_t y_dtype, int64_t ndim, int64_t n, int64_t D, double *compute_us) {
    if (wait_readable(socket, spin_s, (long)timeout_ms) <= 0) return 0;
    const int64_t parts = inbox_recv(&c->in, socket, ZMQ_DONTWAIT);
    if (parts == 0) return 0;
    if (parts < 0) return 3;
    if (parts != 1 || !y) return 2;
    const uint8_t *frame = zmq_msg_data(&c->in.parts[0]);
    header h;
    if (!parse_header(frame, (int64_t)zmq_msg_size(&c->in.parts[0]), c->max_message_bytes, &h)) return 2;
    const tensor_desc *t = &h.t[0];
    if (h.seen != (want == CMD_RUN ? RUN_REPLY_KEYS : PING_KEYS) || h.command != want || h.id != want_id || h.nt != 1 ||
        t->dtype != y_dtype || t->ndim != ndim || t->dims[0] != n || (ndim == 2 && t->dims[1] != D))
        return 2;
    memcpy(y, frame + h.offset[0], (size_t)t->nbytes);
    *compute_us = want == CMD_RUN ? h.compute_us : 0.0;
    inbox_clear(&c->in);
    return 1;
}
