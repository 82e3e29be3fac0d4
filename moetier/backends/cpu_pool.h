/* moetier's native thread pool and CPU lane (included once, by cpu_kernels.c).
 *
 * A pool is `threads` participants: the thread that calls pool_run and
 * threads - 1 helpers it keeps for its lifetime. A job is a list of granules
 * in phases (cpu_kernels.c cuts a call into them, the same cut whatever the
 * thread count; a granule reads only outputs of earlier phases). Each phase
 * is cut into threads + 1 contiguous regions (the last for a thread that
 * joins while it waits: the lane's collector); participant i claims granules
 * from its own region of a phase (one sequential stream of weights per
 * thread, its own counter), then from the others' (so a helper that is late
 * or descheduled costs only what it has claimed, and the caller alone
 * finishes a job when no helper comes: a forked child's pool), and moves to
 * the next phase only when no granule of this one is left to claim. So a
 * granule waits (spinning) only for granules already claimed by running
 * threads. Which thread ran a granule never changes a result: each output is
 * written by exactly one granule from the same inputs.
 *
 * Hand-off: a helper polls for the next job for spin_s after its last one,
 * then sleeps on a condition variable; decode hands over a job every layer,
 * and a futex wake-up costs tens of microseconds on a virtual CPU, a poll
 * that sees the job well under one. The job's sequence number is odd while
 * the caller sets a job up: a helper enters a job only while its number is
 * even and unchanged, and the caller starts setting up only once no helper is
 * inside (busy == 0), so no helper ever reads a half-written job.
 *
 * The lane: calls queued by lane_submit (copied into one of LANE_SLOTS
 * slots) and run in ticket order by the lane's own thread, which is a pool
 * participant (the pool's `call` lock orders it with direct callers), so the
 * submitting thread runs on while the pool computes; lane_collect waits and
 * copies the result out. While it waits it joins the pool's open job as a
 * helper would when the pool leaves a CPU free (`joins`: so a lane of one
 * thread computes on two while its caller waits: 20 -> 23-24 GB/s on Q4_K
 * experts here; where the pool has every CPU, a third thread on two CPUs
 * only took turns with them: 25.2 against 27.3 GB/s for the pool alone), and
 * after spin_s with nothing to claim it sleeps.
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define POOL_THREADS_MAX 256

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* One step of a poll: a pause, and from the 256th on (some microseconds) a sched_yield too, so that a poller
 * sharing a CPU with the thread it waits for (more runnable threads than CPUs: a busy machine) lets it run;
 * with nothing else runnable the yield returns at once. */
static inline void poll_step(int64_t spins) {
    cpu_relax();
    if (spins >= 256) sched_yield();
}

/* Wait for *counter to reach zero: the granules it counts are claimed and running on other threads. */
static void await_zero(const int64_t *counter) {
    for (int64_t spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) != 0; spins++) poll_step(spins);
}

/* Poll *word until it differs from `seen` or spin_s passes (the lane's waits). */
static void spin_while_equal(const int64_t *word, int64_t seen, double spin_s) {
    if (spin_s <= 0) return;
    const double until = monotonic_s() + spin_s;
    for (int64_t spins = 0; __atomic_load_n(word, __ATOMIC_ACQUIRE) == seen && monotonic_s() < until; spins++)
        poll_step(spins);
}

typedef void (*granule_fn)(void *job, int64_t granule);

typedef struct moe_pool moe_pool;
typedef struct { moe_pool *pool; int64_t id; } helper_arg;

#define POOL_PHASES_MAX 4
typedef struct { int64_t next, end, pad[6]; } pool_region;  /* a cache line: granules [next, end) left to claim */

struct moe_pool {
    pthread_mutex_t call;   /* held by the one caller whose job (and the arena) this is */
    pthread_mutex_t mu;     /* for sleeping helpers */
    pthread_cond_t wake;
    int64_t seq;            /* even: the job is open to helpers; odd: being set up */
    int64_t busy;           /* helpers inside the job */
    int64_t sleepers;       /* helpers asleep on `wake` */
    int64_t stop;
    int64_t threads;        /* participants, the caller included */
    int64_t helpers;        /* helper threads running */
    double spin_s;
    granule_fn run;         /* the job: run(job, g) for g < granules */
    void *job;
    int64_t granules, phases, finished;
    int64_t regions_per_phase;  /* threads + 1 */
    pool_region *regions;   /* [POOL_PHASES_MAX, regions_per_phase] */
    void *arena;            /* the job's working memory (cpu_kernels.c carves it), grown as calls need */
    size_t arena_bytes;
    pthread_t tid[POOL_THREADS_MAX];
};

/* As participant `id`: claim and run granules until none is left, phase by phase, own region first; then count
 * them finished, once (one contended write per thread). */
static void pool_work(moe_pool *p, int64_t id) {
    const int64_t P = p->regions_per_phase;
    int64_t done = 0;
    for (int64_t k = 0; k < p->phases; k++)
        for (int64_t j = 0; j < P; j++) {
            pool_region *r = &p->regions[k * P + (id + j) % P];
            for (int64_t g; (g = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED)) < r->end; done++) p->run(p->job, g);
        }
    if (done) __atomic_fetch_add(&p->finished, done, __ATOMIC_RELEASE);
}

/* The next open job's sequence number (even, not `seen`), or -1 once the pool stops. */
static int64_t pool_wait(moe_pool *p, int64_t seen) {
    const double until = p->spin_s > 0 ? monotonic_s() + p->spin_s : 0;
    for (int64_t spins = 0;; spins++) {
        const int64_t s = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE);
        if (!(s & 1) && s != seen) return s;
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return -1;
        if ((spins & 63) == 0 && monotonic_s() >= until) break;
        poll_step(spins);
    }
    pthread_mutex_lock(&p->mu);
    __atomic_fetch_add(&p->sleepers, 1, __ATOMIC_SEQ_CST);
    int64_t s;
    for (;;) {  /* the caller reads `sleepers` after it opens a job: one of us sees the other */
        s = __atomic_load_n(&p->seq, __ATOMIC_SEQ_CST);
        if ((!(s & 1) && s != seen) || p->stop) break;
        pthread_cond_wait(&p->wake, &p->mu);
    }
    __atomic_fetch_sub(&p->sleepers, 1, __ATOMIC_SEQ_CST);
    const int64_t stop = p->stop;
    pthread_mutex_unlock(&p->mu);
    return stop ? -1 : s;
}

/* Work on job `s` as participant `id` if it is still the open one (a helper's entry: see the module comment). */
static void pool_join(moe_pool *p, int64_t s, int64_t id) {
    __atomic_fetch_add(&p->busy, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&p->seq, __ATOMIC_SEQ_CST) == s) pool_work(p, id);
    __atomic_fetch_sub(&p->busy, 1, __ATOMIC_SEQ_CST);
}

/* Whether the open job has a granule left to claim (a racy peek: pool_join decides). */
static int pool_open_work(moe_pool *p) {
    const int64_t P = p->regions_per_phase, k = __atomic_load_n(&p->phases, __ATOMIC_RELAXED) - 1;
    for (int64_t r = 0; k >= 0 && r < P; r++)
        if (__atomic_load_n(&p->regions[k * P + r].next, __ATOMIC_RELAXED) < __atomic_load_n(&p->regions[k * P + r].end, __ATOMIC_RELAXED))
            return 1;
    return 0;
}

static void *pool_main(void *arg) {
    moe_pool *p = ((helper_arg *)arg)->pool;
    const int64_t id = ((helper_arg *)arg)->id;
    free(arg);
    int64_t seen = 0;
    for (int64_t s; (s = pool_wait(p, seen)) >= 0; seen = s) pool_join(p, s, id);
    return NULL;
}

/* Run `job` on every participant, this thread included: phases granules [0, ends[0]), [ends[0], ends[1]), ...,
 * at most POOL_PHASES_MAX; returns when all are done. The caller holds p->call. */
static void pool_run(moe_pool *p, granule_fn run, void *job, int64_t phases, const int64_t *ends) {
    __atomic_store_n(&p->seq, p->seq + 1, __ATOMIC_SEQ_CST);  /* odd: closed */
    for (int64_t spins = 0; __atomic_load_n(&p->busy, __ATOMIC_SEQ_CST); spins++) poll_step(spins);  /* a late helper leaves */
    const int64_t P = p->regions_per_phase, n = ends[phases - 1];
    for (int64_t k = 0; k < phases; k++) {
        const int64_t start = k ? ends[k - 1] : 0, length = ends[k] - start;
        for (int64_t r = 0; r < P; r++)
            p->regions[k * P + r].next = start + r * length / P, p->regions[k * P + r].end = start + (r + 1) * length / P;
    }
    p->run = run, p->job = job, p->granules = n, p->phases = phases, p->finished = 0;
    __atomic_store_n(&p->seq, p->seq + 1, __ATOMIC_SEQ_CST);  /* even: open */
    if (__atomic_load_n(&p->sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    pool_work(p, 0);
    for (int64_t spins = 0; __atomic_load_n(&p->finished, __ATOMIC_ACQUIRE) < n; spins++) poll_step(spins);
}

/* The working memory of one call: at least `bytes`, 64-byte aligned; NULL if out of memory. Caller holds p->call. */
static void *pool_arena(moe_pool *p, size_t bytes) {
    if (bytes > p->arena_bytes) {
        void *bigger = NULL;
        if (posix_memalign(&bigger, 64, bytes)) return NULL;
        free(p->arena);
        p->arena = bigger, p->arena_bytes = bytes;
    }
    return p->arena;
}

moe_pool *pool_open(int64_t threads, double spin_s) {
    if (threads < 1 || threads > POOL_THREADS_MAX) return NULL;
    moe_pool *p = calloc(1, sizeof *p);
    void *regions = NULL;
    if (!p || posix_memalign(&regions, 64, sizeof(pool_region) * POOL_PHASES_MAX * (size_t)(threads + 1))) {
        free(p);
        return NULL;
    }
    p->regions = regions, p->regions_per_phase = threads + 1;
    p->threads = threads, p->spin_s = spin_s;
    pthread_mutex_init(&p->call, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int64_t t = 1; t < threads; t++) {
        helper_arg *a = malloc(sizeof *a);
        if (!a) break;
        a->pool = p, a->id = t;
        if (pthread_create(&p->tid[p->helpers], NULL, pool_main, a) != 0) {
            free(a);
            break;
        }
        p->helpers++;
    }
    return p;
}

/* participants: the caller and the helpers that started (threads - 1 unless a thread could not start) */
int64_t pool_threads(const moe_pool *p) { return 1 + p->helpers; }

void pool_close(moe_pool *p) {
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int64_t t = 0; t < p->helpers; t++) pthread_join(p->tid[t], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->call);
    free(p->arena);
    free(p->regions);
    free(p);
}

/* In a forked child: the helpers stayed in the parent, so the caller computes alone (the same results). */
void pool_forked(moe_pool *p) {
    pthread_mutex_init(&p->call, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->helpers = 0, p->busy = 0, p->sleepers = 0;
    if (p->seq & 1) p->seq++;
}

/* ---------------------------------------------------------------------------------------------------------
 * The lane: decode calls queued for the pool, run by the lane's own thread.
 * ------------------------------------------------------------------------------------------------------- */
#define LANE_SLOTS 16

enum { SLOT_FREE, SLOT_QUEUED, SLOT_RUNNING, SLOT_DONE };
enum { RECORD_WORDS = 5 };  /* int64s per expert record: gate_up, down addresses, their types, flags */

/* cpu_kernels.c: one token through k experts on the pool (moe_decode) */
int64_t moe_decode(moe_pool *pool, const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                   const float *scale, float *out);

typedef struct {
    int64_t state, released, ticket, D, I, k, status;
    double done_s;       /* CLOCK_MONOTONIC seconds when the call finished */
    float *x, *out;      /* [D] each */
    int64_t *experts;    /* [RECORD_WORDS k] */
    float *scale;        /* [k] */
    int64_t cap_d, cap_k;
} lane_slot;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    lane_slot slots[LANE_SLOTS];
    int64_t next_ticket;  /* also read without the lock by the polling lane thread */
    int64_t stop, started;
    int64_t joins;  /* whether a collecting thread joins the pool's open job (the pool leaves a CPU free) */
    double spin_s;
    moe_pool *pool;
    pthread_t tid;
} moe_lane;

static lane_slot *oldest_queued(moe_lane *lane) {
    lane_slot *s = NULL;
    for (int i = 0; i < LANE_SLOTS; i++) {
        lane_slot *c = &lane->slots[i];
        if (c->state == SLOT_QUEUED && (!s || c->ticket < s->ticket)) s = c;
    }
    return s;
}

static void *lane_main(void *arg) {
    moe_lane *lane = arg;
    pthread_mutex_lock(&lane->mu);
    for (;;) {
        lane_slot *s = oldest_queued(lane);
        if (!s) {
            if (lane->stop) break;
            const int64_t seen = lane->next_ticket;
            pthread_mutex_unlock(&lane->mu);
            spin_while_equal(&lane->next_ticket, seen, lane->spin_s);
            pthread_mutex_lock(&lane->mu);
            if (lane->next_ticket == seen && !lane->stop) pthread_cond_wait(&lane->work, &lane->mu);
            continue;
        }
        s->state = SLOT_RUNNING;
        pthread_mutex_unlock(&lane->mu);
        const int64_t status = moe_decode(lane->pool, s->x, s->D, s->I, s->k, s->experts, s->scale, s->out);
        const double done_s = monotonic_s();
        pthread_mutex_lock(&lane->mu);
        s->status = status, s->done_s = done_s;
        __atomic_store_n(&s->state, s->released ? SLOT_FREE : SLOT_DONE, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&lane->done);
    }
    pthread_mutex_unlock(&lane->mu);
    return NULL;
}

moe_lane *lane_open(moe_pool *pool, double spin_s, int64_t joins) {
    moe_lane *lane = calloc(1, sizeof(moe_lane));
    if (!lane) return NULL;
    lane->spin_s = spin_s, lane->pool = pool, lane->joins = joins;
    pthread_mutex_init(&lane->mu, NULL);
    pthread_cond_init(&lane->work, NULL);
    pthread_cond_init(&lane->done, NULL);
    if (pthread_create(&lane->tid, NULL, lane_main, lane) != 0) {
        pthread_cond_destroy(&lane->work), pthread_cond_destroy(&lane->done), pthread_mutex_destroy(&lane->mu);
        free(lane);
        return NULL;
    }
    return lane;
}

static int grow(void **buffer, int64_t need, size_t item) {
    void *bigger = realloc(*buffer, (size_t)need * item);
    if (!bigger) return -1;
    *buffer = bigger;
    return 0;
}

/* Queue one call (experts: RECORD_WORDS k int64s, as moe_decode's); returns its ticket. With every slot taken it
 * waits for a queued call to finish; -1 when all are done but uncollected, -2 when out of memory. */
int64_t lane_submit(moe_lane *lane, const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                    const float *scale) {
    pthread_mutex_lock(&lane->mu);
    lane_slot *s = NULL;
    for (;;) {  /* a free slot; while none, wait for a queued call to finish (none queued: give up) */
        int pending = 0;
        for (int i = 0; i < LANE_SLOTS && !s; i++) {
            if (lane->slots[i].state == SLOT_FREE) s = &lane->slots[i];
            pending |= lane->slots[i].state == SLOT_QUEUED || lane->slots[i].state == SLOT_RUNNING;
        }
        if (s || !pending) break;
        pthread_cond_wait(&lane->done, &lane->mu);
    }
    int64_t ticket = -1;
    if (s) {
        ticket = -2;
        int ok = 1;
        if (D > s->cap_d) {
            ok = !grow((void **)&s->x, D, sizeof(float)) && !grow((void **)&s->out, D, sizeof(float));
            if (ok) s->cap_d = D;
        }
        if (ok && k > s->cap_k) {
            ok = !grow((void **)&s->experts, RECORD_WORDS * k, sizeof(int64_t)) && !grow((void **)&s->scale, k, sizeof(float));
            if (ok) s->cap_k = k;
        }
        if (ok) {
            memcpy(s->x, x, (size_t)D * sizeof(float));
            memcpy(s->experts, experts, (size_t)(RECORD_WORDS * k) * sizeof(int64_t));
            memcpy(s->scale, scale, (size_t)k * sizeof(float));
            s->D = D, s->I = I, s->k = k, s->released = 0, s->status = 0;
            s->ticket = ticket = lane->next_ticket;
            s->state = SLOT_QUEUED;
            __atomic_store_n(&lane->next_ticket, ticket + 1, __ATOMIC_RELEASE);
            pthread_cond_signal(&lane->work);
        }
    }
    pthread_mutex_unlock(&lane->mu);
    return ticket;
}

static lane_slot *slot_of(moe_lane *lane, int64_t ticket) {
    for (int i = 0; i < LANE_SLOTS; i++)
        if (lane->slots[i].state != SLOT_FREE && lane->slots[i].ticket == ticket) return &lane->slots[i];
    return NULL;
}

/* Wait for a ticket, copy its [D] result to out and the time it finished to *done_s; free its slot.
 * Returns 0; -1 for a ticket that is not pending (already collected or released, or never given);
 * -2 when the call ran out of memory. */
int64_t lane_collect(moe_lane *lane, int64_t ticket, float *out, double *done_s) {
    pthread_mutex_lock(&lane->mu);
    lane_slot *s = slot_of(lane, ticket);
    if (!s || s->released) {
        pthread_mutex_unlock(&lane->mu);
        return -1;
    }
    if (s->state != SLOT_DONE) {  /* poll a while, then sleep */
        pthread_mutex_unlock(&lane->mu);
        /* meanwhile, work on the pool's open job (ours, or one queued before it) where the pool leaves a CPU
         * free: a waiting thread computes */
        moe_pool *p = lane->pool;
        const double until = monotonic_s() + lane->spin_s;
        for (int64_t spins = 0; __atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != SLOT_DONE; spins++) {
            const int64_t seq = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE);
            if (lane->joins && !(seq & 1) && pool_open_work(p)) {
                pool_join(p, seq, p->threads);  /* the region kept for a joining thread */
                spins = 0;
            } else if ((spins & 63) == 0 && monotonic_s() >= until) {
                break;
            } else {
                poll_step(spins);
            }
        }
        pthread_mutex_lock(&lane->mu);
    }
    while (s->state != SLOT_DONE) pthread_cond_wait(&lane->done, &lane->mu);
    memcpy(out, s->out, (size_t)s->D * sizeof(float));
    *done_s = s->done_s;
    const int64_t status = s->status;
    s->state = SLOT_FREE;
    pthread_mutex_unlock(&lane->mu);
    return status;
}

/* The caller will not collect this ticket: free its slot now if done, else when it is. */
void lane_release(moe_lane *lane, int64_t ticket) {
    pthread_mutex_lock(&lane->mu);
    lane_slot *s = slot_of(lane, ticket);
    if (s) {
        if (s->state == SLOT_DONE) s->state = SLOT_FREE;
        else s->released = 1;
    }
    pthread_mutex_unlock(&lane->mu);
}

/* Finish queued calls, stop the lane's thread, free everything (the pool stays open). */
void lane_close(moe_lane *lane) {
    pthread_mutex_lock(&lane->mu);
    lane->stop = 1;
    pthread_cond_broadcast(&lane->work);
    pthread_mutex_unlock(&lane->mu);
    pthread_join(lane->tid, NULL);
    for (int i = 0; i < LANE_SLOTS; i++) {
        lane_slot *s = &lane->slots[i];
        free(s->x), free(s->out), free(s->experts), free(s->scale);
    }
    pthread_cond_destroy(&lane->work);
    pthread_cond_destroy(&lane->done);
    pthread_mutex_destroy(&lane->mu);
    free(lane);
}
