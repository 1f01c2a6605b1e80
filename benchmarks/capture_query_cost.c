/* The driver's cost of asking a stream whether it captures: cuStreamGetCaptureInfo (what
 * graphpool's C capture query calls) against cuStreamIsCapturing, each in a tight C loop on
 * a non-blocking stream that does not capture. No Python involved: the floor under
 * graphpool's per-allocation query (benchmarks/NOTES.md, entry 36).
 *   cc -O2 -o /tmp/cqc benchmarks/capture_query_cost.c -ldl && /tmp/cqc
 */
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>

typedef int CUresult;
typedef void *CUstream;
typedef int CUdevice;
typedef void *CUcontext;
typedef CUresult (*init_t)(unsigned);
typedef CUresult (*dev_get_t)(CUdevice *, int);
typedef CUresult (*retain_t)(CUcontext *, CUdevice);
typedef CUresult (*set_t)(CUcontext);
typedef CUresult (*stream_create_t)(CUstream *, unsigned);
typedef CUresult (*info_t)(CUstream, int *, unsigned long long *, void *, void *, size_t *);
typedef CUresult (*is_t)(CUstream, int *);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { printf("no libcuda\n"); return 1; }
    init_t cuInit = (init_t)dlsym(h, "cuInit");
    dev_get_t cuDeviceGet = (dev_get_t)dlsym(h, "cuDeviceGet");
    retain_t cuDevicePrimaryCtxRetain = (retain_t)dlsym(h, "cuDevicePrimaryCtxRetain");
    set_t cuCtxSetCurrent = (set_t)dlsym(h, "cuCtxSetCurrent");
    stream_create_t cuStreamCreate = (stream_create_t)dlsym(h, "cuStreamCreate");
    info_t info = (info_t)dlsym(h, "cuStreamGetCaptureInfo_v2");
    info_t info3 = (info_t)dlsym(h, "cuStreamGetCaptureInfo");
    is_t is = (is_t)dlsym(h, "cuStreamIsCapturing");
    CUdevice d; CUcontext c; CUstream s;
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&c, d) || cuCtxSetCurrent(c) ||
        cuStreamCreate(&s, 1)) { printf("setup failed\n"); return 1; }
    const int n = 2000000;
    for (int round = 0; round < 3; round++) {
        int st; unsigned long long id; double t0;
        t0 = now();
        for (int i = 0; i < n; i++) info(s, &st, &id, NULL, NULL, NULL);
        double a = (now() - t0) / n * 1e9;
        t0 = now();
        for (int i = 0; i < n; i++) info3(s, &st, &id, NULL, NULL, NULL);
        double a3 = (now() - t0) / n * 1e9;
        t0 = now();
        for (int i = 0; i < n; i++) is(s, &st);
        double b = (now() - t0) / n * 1e9;
        printf("round %d: cuStreamGetCaptureInfo_v2 %.1f ns, cuStreamGetCaptureInfo %.1f ns, cuStreamIsCapturing %.1f ns\n", round, a, a3, b);
    }
    return 0;
}
