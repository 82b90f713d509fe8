// The emulator's scheduler (see cuda_runtime.hpp) and its C entry points:
//   tessera_emu_launch  runs a kernel body over a grid, a block at a time, one fiber per thread;
//   tessera_emu_alloc   "global memory" whose end touches an unmapped page, so a read or
//                       write past a buffer's last element faults instead of passing unseen;
//   tessera_emu_free    gives it back.
// x86-64 only: fibers switch with the few instructions below (glibc's swapcontext makes a
// system call per switch, and a kernel switches millions of times).
#include "cuda_runtime.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#error "the CUDA emulator's fibers are written for x86-64"
#endif

// Saves the callee-saved registers and the SSE/x87 control words on the current stack, stores
// the stack pointer in *save_sp, and resumes the stack at next_sp (saved the same way).
extern "C" void tessera_emu_switch(void** save_sp, void* next_sp);
asm(R"(
    .text
    .p2align 4
    .globl tessera_emu_switch
    .hidden tessera_emu_switch
    .type tessera_emu_switch, @function
tessera_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tessera_emu_switch, .-tessera_emu_switch
)");

namespace emu {

thread_local const ThreadView* current = nullptr;
thread_local void* dynamic_shared_base = nullptr;

namespace {

constexpr size_t STACK_BYTES = 256 * 1024;
constexpr size_t SHARED_LIMIT = 48 * 1024;
constexpr size_t SHARED_GUARD = 256;
constexpr unsigned WARP = 32;

enum class Wait : uint8_t { None, Block, Warp, Exchange };

struct Fiber {
    ThreadView view;
    unsigned linear;  // x fastest, then y, then z: CUDA's order, which decides the warps
    void* sp;
    Wait wait;
    uint8_t parity;  // which half of the warp's exchange buffer the next shuffle uses
    bool done;
};

size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }

// One launch in progress on this OS thread.
struct Launch {
    uint3 grid, block;
    unsigned threads, warps;
    unsigned shared_bytes;
    void (*body)(void*);
    void* ctx;

    std::vector<Fiber> fibers;
    std::vector<uint64_t> exchange;  // [warp][parity][lane]
    std::vector<unsigned char> shared;
    char* stacks = nullptr;  // each stack sits above an unmapped guard page
    size_t stack_stride = 0;
    void* scheduler_sp = nullptr;
    Fiber* running = nullptr;
    std::string error;

    ~Launch() {
        if (stacks) munmap(stacks, stack_stride * threads);
    }

    unsigned lanes_in(unsigned warp) const {
        return std::min(WARP, threads - warp * WARP);
    }
};

thread_local Launch* active = nullptr;
thread_local std::string last_error;

[[noreturn]] void fiber_main() {
    Launch& l = *active;
    l.body(l.ctx);
    l.running->done = true;
    tessera_emu_switch(&l.running->sp, l.scheduler_sp);
    __builtin_unreachable();
}

void wait_here(Wait w) {
    Fiber* f = active->running;
    f->wait = w;
    tessera_emu_switch(&f->sp, active->scheduler_sp);
}

// A fresh stack that `tessera_emu_switch` resumes into `fiber_main`.
void* fresh_stack(char* top, uint64_t control_words) {
    auto* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;                                              // fiber_main never returns
    *--sp = reinterpret_cast<uint64_t>(&fiber_main);        // where `ret` goes
    for (int reg = 0; reg < 6; ++reg) *--sp = 0;            // rbp rbx r12 r13 r14 r15
    *--sp = control_words;                                  // mxcsr, x87 control word
    return sp;
}

uint64_t current_control_words() {
    uint32_t mxcsr;
    uint16_t x87;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(x87));
    return mxcsr | (uint64_t)x87 << 32;
}

std::string dims(uint3 d) {
    return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) +
           ")";
}

const char* wait_name(const Fiber& f) {
    if (f.done) return "have exited";
    switch (f.wait) {
        case Wait::Block: return "wait at __syncthreads";
        case Wait::Warp: return "wait at __syncwarp";
        case Wait::Exchange: return "wait in a warp shuffle";
        case Wait::None: break;
    }
    return "are running";
}

// "threads 0-63 wait at __syncthreads, threads 64-127 have exited"
std::string describe_block(const Launch& l) {
    std::string out;
    size_t i = 0;
    while (i < l.fibers.size()) {
        size_t j = i;
        while (j + 1 < l.fibers.size() &&
               wait_name(l.fibers[j + 1]) == wait_name(l.fibers[i]))
            ++j;
        if (!out.empty()) out += ", ";
        out += "threads " + std::to_string(i) + "-" + std::to_string(j) + " " +
               wait_name(l.fibers[i]);
        i = j + 1;
    }
    return out;
}

// Releases every barrier all of whose threads have arrived; says whether it released one.
bool release_barriers(Launch& l) {
    bool released = false;
    bool block_ready = true, anyone_at_block = false;
    for (const Fiber& f : l.fibers) {
        if (f.done) continue;
        if (f.wait == Wait::Block) {
            anyone_at_block = true;
        } else {
            block_ready = false;
        }
    }
    if (block_ready && anyone_at_block) {
        // Threads that exited count as arrived, as on Volta and later GPUs.
        for (Fiber& f : l.fibers) f.wait = Wait::None;
        return true;
    }
    for (unsigned w = 0; w < l.warps; ++w) {
        Fiber* lanes = &l.fibers[w * WARP];
        const unsigned n = l.lanes_in(w);
        const Wait kind = lanes[0].wait;
        if (kind != Wait::Warp && kind != Wait::Exchange) continue;
        bool ready = true;
        for (unsigned i = 0; i < n; ++i) ready &= !lanes[i].done && lanes[i].wait == kind;
        if (!ready) continue;
        for (unsigned i = 0; i < n; ++i) lanes[i].wait = Wait::None;
        released = true;
    }
    return released;
}

bool run_block(Launch& l, uint3 block_idx, uint64_t control_words) {
    std::fill(l.shared.begin(), l.shared.end(), 0xff);  // NaN in every float type
    dynamic_shared_base = l.shared.data();
    for (unsigned i = 0; i < l.threads; ++i) {
        Fiber& f = l.fibers[i];
        f.view = ThreadView{{i % l.block.x, i / l.block.x % l.block.y, i / (l.block.x * l.block.y)},
                            block_idx, l.block, l.grid};
        f.linear = i;
        f.wait = Wait::None;
        f.parity = 0;
        f.done = false;
        f.sp = fresh_stack(l.stacks + (i + 1) * l.stack_stride, control_words);
    }
    const std::string where = "block " + dims(block_idx) + ": ";
    for (;;) {
        bool ran = false, all_done = true;
        for (Fiber& f : l.fibers) {
            if (f.done) continue;
            all_done = false;
            if (f.wait != Wait::None) continue;
            l.running = &f;
            current = &f.view;
            tessera_emu_switch(&l.scheduler_sp, f.sp);
            ran = true;
            if (!l.error.empty()) {
                l.error = where + l.error;
                return false;
            }
        }
        if (all_done) break;
        if (!release_barriers(l) && !ran) {
            l.error = where + "the barriers never line up: " + describe_block(l);
            return false;
        }
    }
    for (size_t i = l.shared_bytes; i < l.shared.size(); ++i) {
        if (l.shared[i] != 0xff) {
            l.error = where + "wrote byte " + std::to_string(i) + " of dynamic shared memory, " +
                      "past the " + std::to_string(l.shared_bytes) + " bytes it was launched with";
            return false;
        }
    }
    return true;
}

std::string check_geometry(uint3 grid, uint3 block, unsigned shared_bytes) {
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.z > 64)
        return "a block of " + dims(block) + " threads: CUDA takes 1 to 1024, z at most 64";
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535)
        return "a grid of " + dims(grid) + " blocks: x takes 1 to 2^31-1, y and z 1 to 65535";
    if (shared_bytes > SHARED_LIMIT)
        return std::to_string(shared_bytes) + " bytes of dynamic shared memory: more than the " +
               "48 KiB a launch gets without opting in";
    return "";
}

}  // namespace

void sync_block() { wait_here(Wait::Block); }

void sync_warp() { wait_here(Wait::Warp); }

uint64_t warp_exchange(uint64_t bits, unsigned src_lane) {
    Launch& l = *active;
    Fiber& f = *l.running;
    const unsigned warp = f.linear / WARP, lane = f.linear % WARP;
    if (src_lane >= l.lanes_in(warp)) {
        l.error = "thread " + std::to_string(f.linear) + " shuffles from lane " +
                  std::to_string(src_lane) + ", which its warp of " +
                  std::to_string(l.lanes_in(warp)) + " lanes does not have";
        wait_here(Wait::Exchange);  // never resumed: the launch stops
    }
    uint64_t* slots = &l.exchange[(warp * 2 + f.parity) * WARP];
    slots[lane] = bits;
    wait_here(Wait::Exchange);
    f.parity ^= 1;
    return slots[src_lane];
}

unsigned lane_id() { return active->running->linear % WARP; }

}  // namespace emu

using emu::Launch;

extern "C" const char* tessera_emu_launch(const unsigned grid[3], const unsigned block[3],
                                          unsigned shared_bytes, void (*body)(void*),
                                          void* ctx) {
    emu::last_error.clear();
    const uint3 g{grid[0], grid[1], grid[2]}, b{block[0], block[1], block[2]};
    if (std::string e = emu::check_geometry(g, b, shared_bytes); !e.empty()) {
        emu::last_error = e;
        return emu::last_error.c_str();
    }
    Launch l;
    l.grid = g;
    l.block = b;
    l.threads = b.x * b.y * b.z;
    l.warps = (l.threads + emu::WARP - 1) / emu::WARP;
    l.shared_bytes = shared_bytes;
    l.body = body;
    l.ctx = ctx;
    l.fibers.resize(l.threads);
    l.exchange.assign((size_t)l.warps * 2 * emu::WARP, 0);
    l.shared.resize(shared_bytes + emu::SHARED_GUARD);
    l.stack_stride = emu::STACK_BYTES + emu::page_size();
    void* stacks = mmap(nullptr, l.stack_stride * l.threads, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) {
        emu::last_error = "cannot map the fibers' stacks";
        return emu::last_error.c_str();
    }
    l.stacks = static_cast<char*>(stacks);
    for (unsigned i = 0; i < l.threads; ++i)  // the guard page below each stack
        mprotect(l.stacks + i * l.stack_stride, emu::page_size(), PROT_NONE);

    emu::active = &l;
    const uint64_t control_words = emu::current_control_words();
    for (unsigned z = 0; z < g.z; ++z)
        for (unsigned y = 0; y < g.y; ++y)
            for (unsigned x = 0; x < g.x; ++x)
                if (!emu::run_block(l, uint3{x, y, z}, control_words)) goto stop;
stop:
    emu::active = nullptr;
    emu::current = nullptr;
    emu::dynamic_shared_base = nullptr;
    if (l.error.empty()) return nullptr;
    emu::last_error = l.error;
    return emu::last_error.c_str();
}

namespace {
size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

// `bytes` at an `align`-aligned address that ends where an unmapped page begins.
extern "C" void* tessera_emu_alloc(size_t bytes, size_t align) {
    bytes = std::max<size_t>(bytes, 1);
    const size_t page = emu::page_size();
    const size_t data = round_up(bytes, page);
    void* region = mmap(nullptr, data + page, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) return nullptr;
    char* base = static_cast<char*>(region);
    mprotect(base + data, page, PROT_NONE);
    return base + data - round_up(bytes, align);
}

extern "C" void tessera_emu_free(void* ptr, size_t bytes) {
    bytes = std::max<size_t>(bytes, 1);
    const size_t page = emu::page_size();
    const size_t data = round_up(bytes, page);
    auto start = reinterpret_cast<uintptr_t>(ptr) / page * page;
    munmap(reinterpret_cast<void*>(start), data + page);
}
