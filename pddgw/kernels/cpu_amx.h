/* What the AMX kernels (cpu_linear.c, cpu_prompt_attention.c) share: whether this build has the
 * tiles (HAVE_AMX), the process's permission to use them (amx_ready), and the tile configuration
 * layout.  Include it after cpu_bf16.h (the tiles' kernels write bfloat16 through it); cpu_build
 * hashes both with each source that includes them. */
#ifndef PDDGW_CPU_AMX_H
#define PDDGW_CPU_AMX_H

#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_BF16) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
#endif

/* 1 where this build has the AMX path and Linux lets the process use the tile registers. */
static inline int amx_ready(void) {
#ifdef HAVE_AMX
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

#endif
