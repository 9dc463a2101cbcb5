/* A cache in front of CPython's arena allocator (PyObject_SetArenaAllocator), for the test processes.

   CPython 3.11 keeps each thread's frames in 16 KiB chunks that it maps (mmap) when a call needs a new one and
   unmaps (munmap) as soon as the call returns. Code that calls in a loop right at a chunk's edge maps and unmaps
   a chunk on every call (CPython issue gh-142183; fixed from 3.13 by keeping one chunk). torch.onnx's tracing and
   Triton's interpreter do: in the suite's workers that was 20,000 mmap/munmap pairs a second and most of the
   CPU time in the kernel. Here freed blocks are kept (up to SLOTS blocks, MAX_CACHED bytes) and handed out again
   for a request of the same size; everything else is mmap and munmap as before, so blocks mapped before this
   allocator was installed are freed the same way. CPython calls its arena allocator with the GIL held; the cache
   takes a lock of its own all the same (a thread state freed on exit must not race another thread). */
#include <pthread.h>
#include <stddef.h>
#include <sys/mman.h>

#define SLOTS 64
#define MAX_CACHED ((size_t)16 << 20)

static void *slot_ptr[SLOTS];
static size_t slot_size[SLOTS];
static size_t cached;
static unsigned long long hits, maps;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void *chunk_alloc(void *ctx, size_t size) {
    (void)ctx;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < SLOTS; i++) {
        if (slot_ptr[i] != NULL && slot_size[i] == size) {
            void *p = slot_ptr[i];
            slot_ptr[i] = NULL;
            cached -= size;
            hits++;
            pthread_mutex_unlock(&lock);
            return p;
        }
    }
    maps++;
    pthread_mutex_unlock(&lock);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void chunk_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    if (ptr == NULL) return;
    pthread_mutex_lock(&lock);
    if (cached + size <= MAX_CACHED) {
        for (int i = 0; i < SLOTS; i++) {
            if (slot_ptr[i] == NULL) {
                slot_ptr[i] = ptr;
                slot_size[i] = size;
                cached += size;
                pthread_mutex_unlock(&lock);
                return;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    munmap(ptr, size);
}

typedef struct {
    void *ctx;
    void *(*alloc)(void *ctx, size_t size);
    void (*free)(void *ctx, void *ptr, size_t size);
} ArenaAllocator; /* PyObjectArenaAllocator's layout */

void stackchunks_fill(ArenaAllocator *a) {
    a->ctx = NULL;
    a->alloc = chunk_alloc;
    a->free = chunk_free;
}

/* blocks handed out again from the cache, and blocks mapped, since the process started */
unsigned long long stackchunks_hits(void) { return hits; }
unsigned long long stackchunks_maps(void) { return maps; }
