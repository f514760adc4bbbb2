/* The simulator's fast engine: the same steps as moelab.simulate.engine.simulate_reference,
 * over arrays. Built with -ffp-contract=off so every floating-point operation rounds as in
 * Python (the parity test compares the two).
 *
 * Returns 0 on success, 1 if some task never ran (a cycle), 2 if memory ran out. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define REL_TOL 1e-9

/* ---- a binary min-heap of int64 keys (ready queues: priority << 40 | task; free servers) */
typedef struct { int64_t *a; int64_t n; } iheap;

static void ih_push(iheap *h, int64_t v) {
    int64_t i = h->n++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (h->a[p] <= v) break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i] = v;
}

static int64_t ih_pop(iheap *h) {
    int64_t top = h->a[0], v = h->a[--h->n], i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->a[c + 1] < h->a[c]) c++;
        if (h->a[c] >= v) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n) h->a[i] = v;
    return top;
}

/* ---- a min-heap of (time, task) timers */
typedef struct { double t; int64_t i; } timer;
typedef struct { timer *a; int64_t n; } theap;

static int t_less(timer x, timer y) { return x.t < y.t || (x.t == y.t && x.i < y.i); }

static void th_push(theap *h, timer v) {
    int64_t i = h->n++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!t_less(v, h->a[p])) break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i] = v;
}

static timer th_pop(theap *h) {
    timer top = h->a[0], v = h->a[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && t_less(h->a[c + 1], h->a[c])) c++;
        if (!t_less(h->a[c], v)) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n) h->a[i] = v;
    return top;
}

static int cmp_i64(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

int moelab_simulate(int64_t n, int32_t R, int32_t P, const int32_t *res, const int32_t *prio,
                    const double *fixed, const double *nbytes, const double *cap, const int32_t *pool,
                    const int64_t *dep_ptr, const int64_t *dep_idx, const int32_t *servers,
                    const double *pool_bw, double *start, double *end, int32_t *server, int64_t *crit,
                    int64_t *events_out) {
    int rc = 0;
    int64_t m = dep_ptr[n], total_servers = 0;
    for (int32_t r = 0; r < R; r++) total_servers += servers[r];
    int64_t *indeg = calloc(n + 1, sizeof(int64_t));
    int64_t *sptr = calloc(n + 2, sizeof(int64_t));
    int64_t *sidx = malloc((m + 1) * sizeof(int64_t));
    char *final = calloc(n + 1, 1);
    double *left = malloc((n + 1) * sizeof(double));
    double *rate = malloc((n + 1) * sizeof(double));
    int64_t *ending = malloc((n + 1) * sizeof(int64_t));
    iheap *ready = calloc(R, sizeof(iheap)), *freeh = calloc(R, sizeof(iheap));
    /* per pool: its tasks in the bandwidth phase, kept sorted by task index */
    int64_t **act = calloc(P + 1, sizeof(int64_t *));
    int64_t *nact = calloc(P + 1, sizeof(int64_t));
    int64_t *order = malloc((total_servers + 1) * sizeof(int64_t));
    theap timers = {malloc((total_servers + 1) * sizeof(timer)), 0};
    if (!indeg || !sptr || !sidx || !final || !left || !rate || !ending || !ready || !freeh || !act || !nact ||
        !order || !timers.a) { rc = 2; goto out; }
    for (int32_t r = 0; r < R; r++) {
        ready[r].a = malloc((n + 1) * sizeof(int64_t));
        freeh[r].a = malloc((servers[r] + 1) * sizeof(int64_t));
        if (!ready[r].a || !freeh[r].a) { rc = 2; goto out; }
        for (int32_t s = 0; s < servers[r]; s++) ih_push(&freeh[r], s);
    }
    for (int32_t p = 0; p < P; p++) {
        act[p] = malloc((total_servers + 1) * sizeof(int64_t));
        if (!act[p]) { rc = 2; goto out; }
    }
    /* successors (CSR, in ascending successor order as the reference appends them) */
    for (int64_t k = 0; k < m; k++) sptr[dep_idx[k] + 1]++;
    for (int64_t i = 0; i < n; i++) sptr[i + 1] += sptr[i];
    {
        int64_t *fill = calloc(n + 1, sizeof(int64_t));
        if (!fill) { rc = 2; goto out; }
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = dep_ptr[j]; k < dep_ptr[j + 1]; k++) {
                int64_t i = dep_idx[k];
                sidx[sptr[i] + fill[i]++] = j;
                indeg[j]++;
            }
        free(fill);
    }
    for (int64_t j = 0; j < n; j++) {
        start[j] = NAN; end[j] = NAN; server[j] = -1; crit[j] = -1;
        if (indeg[j] == 0) ih_push(&ready[res[j]], ((int64_t)prio[j] << 40) | j);
    }
    double now = 0.0;
    int64_t done = 0, events = 0;
    for (;;) {
        for (int32_t r = 0; r < R; r++) {
            while (ready[r].n && freeh[r].n) {
                int64_t i = ih_pop(&ready[r]) & (((int64_t)1 << 40) - 1);
                server[i] = (int32_t)ih_pop(&freeh[r]);
                start[i] = now;
                events++;
                timer tm;
                tm.i = i;
                if (pool[i] < 0 || nbytes[i] == 0) {
                    final[i] = 1;
                    tm.t = now + (fixed[i] + (nbytes[i] > 0 ? nbytes[i] / cap[i] : 0.0));
                } else {
                    tm.t = now + fixed[i];
                }
                th_push(&timers, tm);
            }
        }
        /* water-filling: by ascending cap, ties by task index (act[] is sorted by index) */
        for (int32_t p = 0; p < P; p++) {
            int64_t k = nact[p];
            for (int64_t a = 0; a < k; a++) order[a] = act[p][a];
            for (int64_t a = 1; a < k; a++) { /* stable insertion sort by cap */
                int64_t v = order[a], b = a - 1;
                while (b >= 0 && cap[order[b]] > cap[v]) { order[b + 1] = order[b]; b--; }
                order[b + 1] = v;
            }
            double lft = pool_bw[p];
            int64_t kl = k;
            for (int64_t a = 0; a < k; a++) {
                int64_t i = order[a];
                double share = lft / (double)kl;
                double rr = cap[i] < share ? cap[i] : share;
                rate[i] = rr;
                lft -= rr;
                kl--;
            }
        }
        double t = timers.n ? timers.a[0].t : INFINITY;
        for (int32_t p = 0; p < P; p++)
            for (int64_t a = 0; a < nact[p]; a++) {
                int64_t i = act[p][a];
                double c = now + left[i] / rate[i];
                if (c < t) t = c;
            }
        if (t == INFINITY) break;
        double dt = t - now;
        for (int32_t p = 0; p < P; p++)
            for (int64_t a = 0; a < nact[p]; a++) {
                int64_t i = act[p][a];
                left[i] -= rate[i] * dt;
            }
        now = t;
        int64_t ne = 0;
        while (timers.n && timers.a[0].t <= now) {
            timer tm = th_pop(&timers);
            int64_t i = tm.i;
            events++;
            if (final[i]) {
                ending[ne++] = i;
            } else { /* enter the pool, keeping act[] sorted by task index */
                int32_t p = pool[i];
                int64_t b = nact[p]++;
                while (b > 0 && act[p][b - 1] > i) { act[p][b] = act[p][b - 1]; b--; }
                act[p][b] = i;
                left[i] = nbytes[i];
            }
        }
        for (int32_t p = 0; p < P; p++) {
            int64_t w = 0;
            for (int64_t a = 0; a < nact[p]; a++) {
                int64_t i = act[p][a];
                if (left[i] <= REL_TOL * nbytes[i]) ending[ne++] = i;
                else act[p][w++] = i;
            }
            nact[p] = w;
        }
        qsort(ending, ne, sizeof(int64_t), cmp_i64);
        for (int64_t e = 0; e < ne; e++) {
            int64_t i = ending[e];
            end[i] = now;
            done++;
            events++;
            ih_push(&freeh[res[i]], server[i]);
            for (int64_t k = sptr[i]; k < sptr[i + 1]; k++) {
                int64_t j = sidx[k];
                if (--indeg[j] == 0) {
                    crit[j] = i;
                    ih_push(&ready[res[j]], ((int64_t)prio[j] << 40) | j);
                }
            }
        }
    }
    if (done != n) rc = 1;
    *events_out = events;
out:
    if (ready) for (int32_t r = 0; r < R; r++) free(ready[r].a);
    if (freeh) for (int32_t r = 0; r < R; r++) free(freeh[r].a);
    if (act) for (int32_t p = 0; p < P; p++) free(act[p]);
    free(ready); free(freeh); free(act); free(nact); free(order); free(timers.a);
    free(indeg); free(sptr); free(sidx); free(final); free(left); free(rate); free(ending);
    return rc;
}
