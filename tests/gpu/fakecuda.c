/* A stand-in for the NVIDIA driver library (libcuda.so) for kvxfer's tests
 * on machines without a GPU: the driver-API calls kvxfer makes, with the
 * semantics it relies on, over host memory.
 *
 * "Device memory" is a range of address space mapped PROT_NONE: touching it
 * from the host faults, as touching real device memory would, so a path
 * that treats VRAM as host memory crashes the test instead of passing it.
 * The bytes live in a separate host mapping; the copy calls translate.
 *
 * The bytes are a memfd mapped shared, so that another process can open
 * an allocation's IPC handle (pid and descriptor number of the memfd,
 * reached through /proc/PID/fd) and map the same bytes at a device address
 * of its own; a process cannot open its own handles, as with CUDA.
 *
 * Devices: FAKECUDA_DEVICES (default 2). Contexts: one primary context per
 * device; the current one is per thread, and the calls that need one fail
 * with CUDA_ERROR_INVALID_CONTEXT without it. A dma-buf export succeeds
 * only when FAKECUDA_DMABUF=1 (it hands out a memfd).
 *
 * The VMM API: cuMemCreate makes a physical allocation (a memfd), mapped
 * whole at an address reserved with cuMemAddressReserve; such memory has no
 * legacy IPC handle, and is exported as a POSIX file descriptor (a
 * duplicate of the memfd) only when its creator asked for that handle type.
 * Imported in another process, it is the same bytes.
 *
 * Built by the tests with gcc -shared -fPIC -Wl,-soname,libcuda.so and
 * loaded before kvxfer's first driver call, so that the dlopen of
 * "libcuda.so" finds it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

#define MAX_ALLOCS 4096
#define GRAIN (64u << 10)

struct alloc {
    CUdeviceptr base;
    size_t size;
    size_t mapped; /* size rounded up to GRAIN */
    char *bytes;
    int device;
    int sync_memops;
    int fd;      /* the memfd holding the bytes */
    int opened;  /* mapped from another process's IPC handle */
    unsigned long long copies; /* copies queued into or from it */
    unsigned long long vmm; /* the physical allocation mapped here (VMM), or 0 */
};

struct ipc_handle {
    char magic[8];
    int pid;
    int fd;
    unsigned long long size;
    int device;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc allocs[MAX_ALLOCS];
static int initialised;
static __thread int current = -1; /* device of the current context */
static unsigned long long batched_copies;

static int devices(void) {
    const char *s = getenv("FAKECUDA_DEVICES");
    return s ? atoi(s) : 2;
}

/* The allocation containing p, or NULL; call with the lock held. */
static struct alloc *find(CUdeviceptr p) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].size && p >= allocs[i].base && p < allocs[i].base + allocs[i].size)
            return &allocs[i];
    return NULL;
}

CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    initialised = 1;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *v) {
    *v = 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *n) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *n = devices();
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(int *dev, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= devices()) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev < 0 || dev >= devices()) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = (void *)(uintptr_t)(0x1000 + dev);
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(void *ctx) {
    uintptr_t c = (uintptr_t)ctx;
    if (c < 0x1000 || c >= 0x1000 + (uintptr_t)devices()) return CUDA_ERROR_INVALID_CONTEXT;
    current = (int)(c - 0x1000);
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *s = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    if (dev < 0 || dev >= devices()) return CUDA_ERROR_INVALID_DEVICE;
    *v = (attr == 124 /* DMA_BUF_SUPPORTED */) ? (getenv("FAKECUDA_DMABUF") != NULL) : 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetPCIBusId(char *buf, int len, int dev) {
    if (dev < 0 || dev >= devices() || len < 13) return CUDA_ERROR_INVALID_VALUE;
    snprintf(buf, (size_t)len, "0000:%02X:00.0", 0x10 + dev);
    return CUDA_SUCCESS;
}

/* Maps memfd `fd` as a new allocation (a reserved device address and the
 * shared bytes) and records it; the allocation owns `fd`. */
static CUresult track(CUdeviceptr *p, int fd, size_t size, size_t mapped, int device, int opened) {
    /* The device address: reserved, inaccessible from the host. */
    void *va = mmap(NULL, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (va == MAP_FAILED) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *bytes = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (bytes == MAP_FAILED) {
        munmap(va, mapped);
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].size == 0) {
            allocs[i] = (struct alloc){(CUdeviceptr)(uintptr_t)va, size, mapped, bytes, device, 0, fd, opened};
            pthread_mutex_unlock(&lock);
            *p = (CUdeviceptr)(uintptr_t)va;
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    munmap(va, mapped);
    munmap(bytes, mapped);
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Unmaps and forgets allocation `a`; call with the lock held. */
static void untrack(struct alloc *a) {
    munmap((void *)(uintptr_t)a->base, a->mapped);
    munmap(a->bytes, a->mapped);
    close(a->fd);
    memset(a, 0, sizeof *a);
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t mapped = (size + GRAIN - 1) / GRAIN * GRAIN;
    int fd = memfd_create("fakecuda-vram", 0);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)mapped) != 0) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return track(p, fd, size, mapped, current, 0);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    if (!a || a->base != p || a->opened || a->vmm) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    untrack(a);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuIpcGetMemHandle(void *out, CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    if (!a || a->opened || a->vmm) { /* VMM memory has no legacy handle */
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct ipc_handle h = {"fakeipc", getpid(), a->fd, a->mapped, a->device};
    pthread_mutex_unlock(&lock);
    memset(out, 0, 64);
    memcpy(out, &h, sizeof h);
    return CUDA_SUCCESS;
}

/* The handle arrives by value: 64 bytes, passed as the struct CUDA's
 * CUipcMemHandle is (a 64-byte struct by value, in memory on x86-64). */
struct handle64 {
    char reserved[64];
};

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, struct handle64 raw, unsigned flags) {
    (void)flags;
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct ipc_handle h;
    memcpy(&h, raw.reserved, sizeof h);
    if (memcmp(h.magic, "fakeipc", 8) != 0) return CUDA_ERROR_INVALID_VALUE;
    if (h.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* not one's own */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    return track(p, fd, (size_t)h.size, (size_t)h.size, h.device, 1);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    if (!a || a->base != p || !a->opened) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    untrack(a);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- the VMM API ---- */

#define MAX_PHYS 1024
#define VMM_GRAIN (2u << 20)
#define HANDLE_POSIX_FD 1

/* A physical allocation: handle = index + 1. */
static struct phys {
    int fd;
    size_t size;
    int device;
    int types; /* the handle types its creator asked for */
    int refs;  /* the creator's or importer's handle, and each mapping */
} phys[MAX_PHYS];

/* CUmemAllocationProp as the driver lays it out. */
struct mem_prop {
    int type;
    int requested_handle_types;
    struct { int type; int id; } location;
    void *win32;
    unsigned char compression, rdma;
    unsigned short usage;
    unsigned char reserved[4];
};

struct access_desc {
    struct { int type; int id; } location;
    int flags;
};

/* Call with the lock held. */
static struct phys *phys_of(unsigned long long h) {
    if (h == 0 || h > MAX_PHYS || phys[h - 1].refs == 0) return NULL;
    return &phys[h - 1];
}

/* Drops one reference; call with the lock held. */
static void phys_put(struct phys *p) {
    if (--p->refs == 0) {
        close(p->fd);
        memset(p, 0, sizeof *p);
    }
}

/* Records memfd `fd` (owned) as a new physical allocation; its handle or 0. */
static unsigned long long phys_new(int fd, size_t size, int device, int types) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_PHYS; i++) {
        if (phys[i].refs == 0) {
            phys[i] = (struct phys){fd, size, device, types, 1};
            pthread_mutex_unlock(&lock);
            return (unsigned long long)i + 1;
        }
    }
    pthread_mutex_unlock(&lock);
    close(fd);
    return 0;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const struct mem_prop *prop, int option) {
    (void)option;
    if (!prop || prop->location.id < 0 || prop->location.id >= devices()) return CUDA_ERROR_INVALID_DEVICE;
    *g = VMM_GRAIN;
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(unsigned long long *h, size_t size, const struct mem_prop *prop, unsigned long long flags) {
    if (flags != 0 || !prop || size == 0 || size % VMM_GRAIN) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= devices()) return CUDA_ERROR_INVALID_DEVICE;
    int fd = memfd_create("fakecuda-vmm", MFD_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *h = phys_new(fd, size, prop->location.id, prop->requested_handle_types);
    return *h ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemRelease(unsigned long long h) {
    pthread_mutex_lock(&lock);
    struct phys *p = phys_of(h);
    if (p) phys_put(p);
    pthread_mutex_unlock(&lock);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)align;
    (void)flags;
    if (size == 0 || size % VMM_GRAIN || addr) return CUDA_ERROR_INVALID_VALUE;
    void *va = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (va == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)va;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&lock);
    int mapped = find(ptr) != NULL;
    pthread_mutex_unlock(&lock);
    if (mapped) return CUDA_ERROR_INVALID_VALUE; /* unmap first */
    return munmap((void *)(uintptr_t)ptr, size) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Maps physical allocation h whole at ptr (reserved): the only shape the
 * stand-in takes (offset 0, its size). */
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long h, unsigned long long flags) {
    if (offset != 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct phys *p = phys_of(h);
    if (!p || p->size != size || find(ptr)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    int fd = dup(p->fd);
    void *bytes = fd < 0 ? MAP_FAILED : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (bytes == MAP_FAILED) {
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].size == 0) {
            allocs[i] = (struct alloc){ptr, size, size, bytes, p->device, 0, fd, 0};
            allocs[i].vmm = h;
            p->refs++;
            pthread_mutex_unlock(&lock);
            return CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    munmap(bytes, size);
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Opens a mapping to a device: the mapping is then that device's. */
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct access_desc *desc, size_t count) {
    if (count != 1 || !desc || desc->location.id < 0 || desc->location.id >= devices()) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(ptr);
    int ok = a && a->vmm && a->base == ptr && a->mapped == size;
    if (ok) a->device = desc->location.id;
    pthread_mutex_unlock(&lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(ptr);
    if (!a || !a->vmm || a->base != ptr || a->mapped != size) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct phys *p = phys_of(a->vmm);
    munmap(a->bytes, a->mapped);
    close(a->fd);
    memset(a, 0, sizeof *a); /* the address stays reserved */
    if (p) phys_put(p);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuMemRetainAllocationHandle(unsigned long long *h, void *addr) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find((CUdeviceptr)(uintptr_t)addr);
    struct phys *p = a && a->vmm ? phys_of(a->vmm) : NULL;
    if (p) {
        p->refs++;
        *h = a->vmm;
    }
    pthread_mutex_unlock(&lock);
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long flags) {
    if (type != HANDLE_POSIX_FD || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct phys *p = phys_of(h);
    int fd = -1;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (p && !(p->types & HANDLE_POSIX_FD)) {
        r = CUDA_ERROR_NOT_SUPPORTED; /* not asked for at cuMemCreate */
    } else if (p && (fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0)) >= 0) {
        *(int *)out = fd;
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* The descriptor stays the caller's; the device is set by cuMemSetAccess. */
CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
    if (type != HANDLE_POSIX_FD) return CUDA_ERROR_INVALID_VALUE;
    int fd = fcntl((int)(intptr_t)os, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return CUDA_ERROR_INVALID_VALUE;
    off_t size = lseek(fd, 0, SEEK_END);
    if (size <= 0 || size % VMM_GRAIN) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *h = phys_new(fd, (size_t)size, 0, HANDLE_POSIX_FD);
    return *h ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    CUresult r = CUDA_SUCCESS;
    if (!a) {
        r = CUDA_ERROR_INVALID_VALUE; /* as for host memory unknown to CUDA */
    } else if (attr == 2 /* MEMORY_TYPE */) {
        *(unsigned *)data = 2; /* CU_MEMORYTYPE_DEVICE */
    } else if (attr == 9 /* DEVICE_ORDINAL */) {
        *(int *)data = a->device;
    } else if (attr == 6 /* SYNC_MEMOPS */) {
        *(int *)data = a->sync_memops;
    } else {
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* As the driver: VMM memory refuses SYNC_MEMOPS (the context's flag,
 * cuCtxSetFlags, stands for it). */
CUresult cuPointerSetAttribute(const void *value, int attr, CUdeviceptr p) {
    if (attr != 6 /* SYNC_MEMOPS */) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    int vmm = a && a->vmm;
    if (a && !vmm) a->sync_memops = *(const unsigned *)value != 0;
    pthread_mutex_unlock(&lock);
    return vmm ? CUDA_ERROR_NOT_SUPPORTED : a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static unsigned ctx_flags[64];

CUresult cuCtxGetFlags(unsigned *flags) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *flags = ctx_flags[current];
    return CUDA_SUCCESS;
}

CUresult cuCtxSetFlags(unsigned flags) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_flags[current] = flags;
    return CUDA_SUCCESS;
}

/* Test control: the flags of device's primary context. */
unsigned fakecuda_ctx_flags(int device) {
    return ctx_flags[device];
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    if (a) {
        if (base) *base = a->base;
        if (size) *size = a->size;
    }
    pthread_mutex_unlock(&lock);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Streams run their work on a thread of their own, in order, each copy
 * after a short random delay: a caller that reuses a buffer before waiting
 * for the copy that reads it, or reads a destination before the copy has
 * landed, sees wrong bytes. Events mark a point in a stream.
 *
 * For the tests, each about the copies into or from one allocation (named
 * by its base address), so that tests running side by side do not meet:
 * fakecuda_hold(base) keeps them from starting until fakecuda_hold(0);
 * fakecuda_copies_with(base) counts those queued; and
 * fakecuda_fail_copy_with(base) makes the next one queued fail when it
 * runs, as an asynchronous fault does: it copies nothing, and waiting for
 * it or anything after it in its stream fails with
 * CUDA_ERROR_ILLEGAL_ADDRESS. */
struct op {
    struct op *next;
    char *dst;
    const char *src;
    size_t n;
    CUdeviceptr into, from; /* the destination's and source's allocations (0: host) */
    int fail;
    /* A launch of the piece-copy kernel (kernel_n > 0): the table of
     * (dst, src, len) entries at device address kernel_table, read when the
     * launch runs (after the copies before it in the stream). */
    CUdeviceptr kernel_table;
    unsigned kernel_n;
    /* For a launch whose table is in pinned host memory (read at launch):
     * the allocations it touches (the first 8), held and counted as a
     * copy's are, at launch. */
    CUdeviceptr touched[8];
    int counted;
};

static void run_kernel(struct op *o);

static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static CUdeviceptr held;
static CUdeviceptr fail_with;

void fakecuda_hold(CUdeviceptr base) {
    pthread_mutex_lock(&hold_mu);
    held = base;
    pthread_cond_broadcast(&hold_cv);
    pthread_mutex_unlock(&hold_mu);
}

void fakecuda_fail_copy_with(CUdeviceptr base) {
    pthread_mutex_lock(&hold_mu);
    fail_with = base;
    pthread_mutex_unlock(&hold_mu);
}

struct stream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    struct op *head, *tail;
    unsigned long long enqueued, completed;
    unsigned long long failed; /* the first failed op's number, or 0 */
    int stop;
    unsigned seed;
};

struct event {
    struct stream *stream;
    unsigned long long seq;
};

static void *stream_main(void *arg) {
    struct stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head) break;
        struct op *o = s->head;
        pthread_mutex_unlock(&s->mu);
        if (o->n) {
            pthread_mutex_lock(&hold_mu);
            while (held && (held == o->into || held == o->from)) pthread_cond_wait(&hold_cv, &hold_mu);
            pthread_mutex_unlock(&hold_mu);
            usleep(rand_r(&s->seed) % 300);
            if (!o->fail) memmove(o->dst, o->src, o->n);
        }
        if (o->kernel_n) {
            pthread_mutex_lock(&hold_mu);
            for (int t = 0; t < 8 && held; t++)
                while (held && held == o->touched[t]) pthread_cond_wait(&hold_cv, &hold_mu);
            pthread_mutex_unlock(&hold_mu);
            usleep(rand_r(&s->seed) % 300);
            if (!o->fail) run_kernel(o);
        }
        pthread_mutex_lock(&s->mu);
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->completed++;
        if (o->fail && !s->failed) s->failed = s->completed;
        free(o);
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Queues a copy (n > 0) into allocation `into` from allocation `from`
 * (0: host memory) or a marker (n == 0); returns its sequence number. */
static unsigned long long enqueue(struct stream *s, char *dst, const char *src, size_t n,
                                  CUdeviceptr into, CUdeviceptr from) {
    struct op *o = calloc(1, sizeof *o);
    o->dst = dst;
    o->src = src;
    o->n = n;
    o->into = into;
    o->from = from;
    if (n) {
        pthread_mutex_lock(&hold_mu);
        if (fail_with && (fail_with == into || fail_with == from)) {
            o->fail = 1;
            fail_with = 0;
        }
        pthread_mutex_unlock(&hold_mu);
    }
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    unsigned long long seq = ++s->enqueued;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return seq;
}

/* Waits until op `seq` has run; fails if it or an op before it failed. */
static CUresult wait_for(struct stream *s, unsigned long long seq) {
    pthread_mutex_lock(&s->mu);
    while (s->completed < seq) pthread_cond_wait(&s->cv, &s->mu);
    int failed = s->failed && s->failed <= seq;
    pthread_mutex_unlock(&s->mu);
    return failed ? CUDA_ERROR_ILLEGAL_ADDRESS : CUDA_SUCCESS;
}

CUresult cuStreamCreate(void **out, unsigned flags) {
    (void)flags;
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->seed = (unsigned)(uintptr_t)s;
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0) {
        free(s);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(void *p) {
    struct stream *s = p;
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    unsigned long long seq = s->enqueued;
    pthread_mutex_unlock(&s->mu);
    return wait_for(s, seq);
}

CUresult cuStreamDestroy_v2(void *p) {
    struct stream *s = p;
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    free(s);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(void **out, unsigned flags) {
    (void)flags;
    *out = calloc(1, sizeof(struct event));
    return *out ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuEventRecord(void *e, void *s) {
    if (!e || !s) return CUDA_ERROR_INVALID_VALUE;
    struct event *ev = e;
    ev->stream = s;
    ev->seq = enqueue(s, NULL, NULL, 0, 0, 0);
    return CUDA_SUCCESS;
}

CUresult cuEventSynchronize(void *e) {
    struct event *ev = e;
    if (!ev) return CUDA_ERROR_INVALID_VALUE;
    return ev->stream ? wait_for(ev->stream, ev->seq) : CUDA_SUCCESS;
}

CUresult cuEventQuery(void *e) {
    struct event *ev = e;
    if (!ev) return CUDA_ERROR_INVALID_VALUE;
    if (!ev->stream) return CUDA_SUCCESS;
    struct stream *s = ev->stream;
    pthread_mutex_lock(&s->mu);
    CUresult r = s->completed < ev->seq ? CUDA_ERROR_NOT_READY
                 : (s->failed && s->failed <= ev->seq) ? CUDA_ERROR_ILLEGAL_ADDRESS
                 : CUDA_SUCCESS;
    pthread_mutex_unlock(&s->mu);
    return r;
}

CUresult cuEventDestroy_v2(void *e) {
    free(e);
    return CUDA_SUCCESS;
}

/* Page-aligned, as the real driver's pinned memory is (direct I/O from
 * staging buffers relies on it). */
/* Pinned host allocations, which kernels may read and write (as the real
 * driver maps them into the device's address space); other host memory a
 * kernel touches is an illegal address. */
#define MAX_PINNED 1024
static struct { char *p; size_t n; } pinned[MAX_PINNED];

CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    if (posix_memalign(p, 4096, n ? n : 1) != 0) {
        *p = NULL;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_PINNED; i++)
        if (!pinned[i].p) {
            pinned[i].p = *p;
            pinned[i].n = n ? n : 1;
            break;
        }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_PINNED; i++)
        if (pinned[i].p == p) pinned[i].p = NULL;
    pthread_mutex_unlock(&lock);
    free(p);
    return CUDA_SUCCESS;
}

/* Whether [p, p + n) lies in one pinned host allocation. Call with the lock
 * held. */
static int is_pinned(CUdeviceptr p, size_t n) {
    for (int i = 0; i < MAX_PINNED; i++) {
        CUdeviceptr b = (CUdeviceptr)(uintptr_t)pinned[i].p;
        if (pinned[i].p && p >= b && n <= pinned[i].n - (size_t)(p - b)) return 1;
    }
    return 0;
}

/* Host address of [p, p + n): the bytes behind a device range (which must
 * lie in one allocation), or p itself for host memory. NULL if a device
 * range overruns its allocation. Call with the lock held. */
static char *host_of(CUdeviceptr p, size_t n) {
    struct alloc *a = find(p);
    if (!a) return (char *)(uintptr_t)p;
    if (n > a->size - (size_t)(p - a->base)) return NULL;
    return a->bytes + (p - a->base);
}

/* Counts a copy dst <- src with the allocations it touches and names them
 * (0: host memory). Call with the lock held. */
static void counted(CUdeviceptr dst, CUdeviceptr src, CUdeviceptr *into, CUdeviceptr *from) {
    struct alloc *d = find(dst), *s = find(src);
    if (d) {
        d->copies++;
        *into = d->base;
    }
    if (s) {
        if (s != d) s->copies++;
        *from = s->base;
    }
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!stream) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    char *d = host_of(dst, n), *s = host_of(src, n);
    CUdeviceptr into = 0, from = 0;
    if (n) counted(dst, src, &into, &from);
    pthread_mutex_unlock(&lock);
    if (!d || !s) return CUDA_ERROR_INVALID_VALUE;
    if (n) enqueue(stream, d, s, n, into, from);
    return CUDA_SUCCESS;
}

/* CUDA 12.8's batched copy: the copies queued in order, as one call. */
struct memcpy_attrs {
    int src_access_order;
    int src_loc[2];
    int dst_loc[2];
    unsigned flags;
};

CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                            struct memcpy_attrs *attrs, size_t *attr_idxs, size_t num_attrs,
                            size_t *fail_idx, void *stream) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!stream || count == 0 || num_attrs == 0 || attr_idxs[0] != 0) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < num_attrs; i++)
        if (attrs[i].src_access_order < 1 || attrs[i].src_access_order > 3) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        pthread_mutex_lock(&lock);
        char *d = host_of(dsts[i], sizes[i]), *s = host_of(srcs[i], sizes[i]);
        CUdeviceptr into = 0, from = 0;
        counted(dsts[i], srcs[i], &into, &from);
        pthread_mutex_unlock(&lock);
        if (!d || !s || sizes[i] == 0) {
            *fail_idx = i;
            return CUDA_ERROR_INVALID_VALUE;
        }
        enqueue(stream, d, s, sizes[i], into, from);
    }
    __atomic_fetch_add(&batched_copies, count, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* The piece-copy kernel (src/gpu/kernels/copy_pieces.cu), run by the
 * stream's thread: each table entry copies len bytes src -> dst, both
 * device memory or pinned host memory, as the real kernel's loads and
 * stores would (other host memory there would fault: here the launch fails
 * as an illegal address does).
 * FAKECUDA_NO_KERNEL=1 makes loading its module fail, as a driver too old
 * for the PTX would. */
struct module { char magic[8]; };
static struct module the_module = { "fakemod" };
static unsigned long long kernel_launches, kernel_entries;

CUresult cuModuleLoadData(void **module, const void *image) {
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (getenv("FAKECUDA_NO_KERNEL")) return 218; /* CUDA_ERROR_INVALID_PTX */
    if (!strstr(image, ".entry kvxfer_copy_pieces(")) return 218;
    *module = &the_module;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(void **f, void *module, const char *name) {
    if (module != &the_module || strcmp(name, "kvxfer_copy_pieces")) return 500; /* NOT_FOUND */
    *f = &the_module;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, void *stream, void **params, void **extra) {
    (void)shmem;
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (f != &the_module || !stream || !params || extra || gx == 0 || gy != 1 || gz != 1 ||
        bx == 0 || bx > 1024 || by != 1 || bz != 1)
        return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr table = *(CUdeviceptr *)params[0];
    unsigned n = *(unsigned *)params[1];
    pthread_mutex_lock(&lock);
    struct alloc *a = find(table);
    int ok = a ? n <= (a->size - (size_t)(table - a->base)) / 24 : is_pinned(table, (size_t)n * 24);
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    if (!n) return CUDA_SUCCESS;
    struct op *o = calloc(1, sizeof *o);
    o->kernel_table = table;
    o->kernel_n = n;
    if (!a) {
        /* A table in pinned host memory is there at launch: count the
         * copies and note what they touch now, as cuMemcpyAsync does. */
        const unsigned long long *t = (const unsigned long long *)(uintptr_t)table;
        int k = 0;
        pthread_mutex_lock(&lock);
        for (unsigned i = 0; i < n; i++) {
            CUdeviceptr into = 0, from = 0;
            counted(t[3 * i], t[3 * i + 1], &into, &from);
            CUdeviceptr both[2] = {into, from};
            for (int j = 0; j < 2; j++) {
                int seen = !both[j];
                for (int m = 0; m < k && !seen; m++) seen = o->touched[m] == both[j];
                if (!seen && k < 8) o->touched[k++] = both[j];
            }
        }
        pthread_mutex_unlock(&lock);
        o->counted = 1;
        pthread_mutex_lock(&hold_mu);
        for (int m = 0; m < k && fail_with; m++)
            if (o->touched[m] == fail_with) {
                o->fail = 1;
                fail_with = 0;
            }
        pthread_mutex_unlock(&hold_mu);
    }
    struct stream *s = stream;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    s->enqueued++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    __atomic_fetch_add(&kernel_launches, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&kernel_entries, n, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

static void run_kernel(struct op *o) {
    pthread_mutex_lock(&lock);
    const unsigned long long *t = (const unsigned long long *)host_of(o->kernel_table, (size_t)o->kernel_n * 24);
    for (unsigned i = 0; t && i < o->kernel_n; i++) {
        CUdeviceptr dst = t[3 * i], src = t[3 * i + 1];
        size_t n = t[3 * i + 2];
        struct alloc *d = find(dst), *s = find(src);
        char *dh = host_of(dst, n), *sh = host_of(src, n);
        if ((!d && !is_pinned(dst, n)) || (!s && !is_pinned(src, n)) || !dh || !sh) {
            o->fail = 1;
            break;
        }
        if (!o->counted) {
            if (d) d->copies++;
            if (s && s != d) s->copies++;
        }
        memmove(dh, sh, n);
    }
    pthread_mutex_unlock(&lock);
}

/* Launches of the piece-copy kernel, and table entries copied by them, so
 * far (for the tests). */
unsigned long long fakecuda_kernel_launches(void) {
    return __atomic_load_n(&kernel_launches, __ATOMIC_RELAXED);
}

unsigned long long fakecuda_kernel_entries(void) {
    return __atomic_load_n(&kernel_entries, __ATOMIC_RELAXED);
}

/* Copies queued into or from the allocation based at `base` so far. */
unsigned long long fakecuda_copies_with(CUdeviceptr base) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(base);
    unsigned long long n = a ? a->copies : 0;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Copies issued through cuMemcpyBatchAsync so far (for the tests). */
unsigned long long fakecuda_batched_copies(void) {
    return __atomic_load_n(&batched_copies, __ATOMIC_RELAXED);
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t size, int type, unsigned long long flags) {
    (void)flags;
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (type != 1 /* DMA_BUF_FD */ || !getenv("FAKECUDA_DMABUF")) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    int ok = a && size <= a->mapped - (size_t)(p - a->base);
    pthread_mutex_unlock(&lock);
    if (!ok) return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("fakecuda-dmabuf", MFD_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)handle = fd;
    return CUDA_SUCCESS;
}
