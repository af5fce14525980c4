/*
 * Orisha unikernel entry.
 *
 * QEMU (microvm via qboot, pc/q35 via the pvh.bin option ROM) loads this ELF
 * and jumps to the address in the XEN_ELFNOTE_PHYS32_ENTRY note in 32-bit
 * protected mode, paging off, %ebx = physical address of hvm_start_info.
 * We build identity-mapped page tables for the low 4 GiB (1 GiB or 2 MiB pages,
 * the top of the 4th GiB uncached for MMIO: virtio-mmio, IOAPIC, LAPIC), enter
 * long mode and call platform_main(start_info). All pages are user-accessible:
 * the unikernel continues in ring 3 (see cpu.c).
 *
 * An application processor (smp.c) starts in real mode at the trampoline below,
 * copied to AP_BASE: it enters protected mode and then long mode through the same
 * steps as the boot processor (enter_long_mode: MTRRs are per CPU, so are CR0/CR4/
 * EFER), on these page tables, and calls platform_ap_main(cpu) on the stack smp.c
 * set aside for it.
 */
#include "boot.h"
#define XEN_ELFNOTE_PHYS32_ENTRY 18
#define STACK_SIZE (64 * 1024)
/* A trampoline label's address once copied to AP_BASE. */
#define AP_T(x) ((x) - platform_ap_trampoline + AP_BASE)

    .section .note.pvh, "a", @note
    .p2align 2
    .long 4                      /* namesz */
    .long 4                      /* descsz */
    .long XEN_ELFNOTE_PHYS32_ENTRY
    .asciz "Xen"
    .long platform_pvh_entry

    .section .boot.text, "ax"
    .code32
    .globl platform_pvh_entry
platform_pvh_entry:
    cli
    cld
    movl %ebx, %esi                     /* keep start_info */
    movl $boot_stack_top, %esp

    /* PML4[0] -> PDPT */
    movl $boot_pdpt, %eax
    orl  $0x7, %eax
    movl %eax, boot_pml4

    /* 1 GiB pages if the CPU has them (CPUID 0x80000001 EDX.26): 4 PDPT
     * entries instead of 2048 PD entries. Setup code runs before we reach
     * ring 3, which some hypervisors emulate instruction by instruction, so
     * fewer instructions here means faster boot. */
    movl $0x80000000, %eax
    cpuid
    cmpl $0x80000001, %eax
    jb   6f
    movl $0x80000001, %eax
    cpuid
    testl $(1 << 26), %edx
    jz   6f
    movl $boot_pdpt, %edi
    movl $0x87, 0(%edi)                 /* 0-1 GiB: P | RW | US | PS */
    movl $0x40000087, 8(%edi)           /* 1-2 GiB */
    movl $0x80000087, 16(%edi)          /* 2-3 GiB */
    movl $0xc000009f, 24(%edi)          /* 3-4 GiB: + PWT | PCD (MMIO lives here) */
    jmp  7f

6:  /* PDPT[0..3] -> PD0..PD3 */
    movl $boot_pd, %eax
    orl  $0x7, %eax
    movl $boot_pdpt, %edi
    movl $4, %ecx
1:  movl %eax, (%edi)
    addl $4096, %eax
    addl $8, %edi
    loop 1b

    /* 2048 x 2 MiB pages, identity; entries >= 0xfe000000 get PCD|PWT */
    movl $boot_pd, %edi
    xorl %ecx, %ecx
2:  movl %ecx, %eax
    shll $21, %eax
    orl  $0x87, %eax                    /* P | RW | US | PS */
    cmpl $2032, %ecx
    jb   3f
    orl  $0x18, %eax                    /* PWT | PCD */
3:  movl %eax, (%edi)
    addl $8, %edi
    incl %ecx
    cmpl $2048, %ecx
    jne  2b
7:
    movl $long_entry, %ebp
    /* fall through */

/*
 * From 32-bit protected mode, paging off, a stack, %ebp = a 64-bit entry point:
 * MTRRs, PAE, LME, paging on boot_pml4, the kernel's GDT, then a far return into
 * its 64-bit code segment at %ebp. Shared by the boot processor and every AP.
 * Keeps %esi and %ebp.
 */
enter_long_mode:
    /*
     * If the firmware left the MTRRs disabled (qboot does no MTRR setup),
     * all memory is uncached wherever the hypervisor honours guest MTRRs.
     * Enable them with write-back as the default type; MMIO pages are made
     * UC through PCD|PWT above. SeaBIOS' setup is left alone.
     */
    movl $1, %eax
    cpuid
    testl $(1 << 12), %edx              /* MTRR supported? */
    jz   5f
    movl $0x2ff, %ecx                   /* IA32_MTRR_DEF_TYPE */
    rdmsr
    testl $(1 << 11), %eax              /* already enabled by firmware (SeaBIOS) */
    jnz  5f
    movl $((1 << 11) | 6), %eax         /* E | default type WB */
    xorl %edx, %edx
    wrmsr
5:
    movl $boot_pml4, %eax
    movl %eax, %cr3
    movl %cr4, %eax
    orl  $(1 << 5), %eax                /* PAE */
    movl %eax, %cr4
    movl $0xc0000080, %ecx              /* EFER */
    rdmsr
    orl  $(1 << 8), %eax                /* LME */
    wrmsr
    movl %cr0, %eax
    orl  $0x80000001, %eax              /* PG | PE */
    andl $~0x60000000, %eax             /* clear CD | NW */
    movl %eax, %cr0
    lgdt boot_gdt_ptr
    pushl $0x08
    pushl %ebp
    lret

    .code64
long_entry:
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    xorw %ax, %ax
    movw %ax, %fs
    movw %ax, %gs
    movq $boot_stack_top, %rsp
    xorq %rbp, %rbp
    movl %esi, %edi                     /* arg0: start_info physical address */
    call platform_main
4:  cli
    hlt
    jmp 4b

/*
 * The application processor's real-mode start (SIPI vector AP_BASE >> 12), copied to
 * AP_BASE by smp.c: CS = AP_BASE >> 4, IP = 0. A flat 32-bit GDT of its own (the
 * kernel's 0x08 is 64-bit code, which protected mode cannot run yet), protected
 * mode, the top of the trampoline page as a stack (one AP starts at a time), then
 * enter_long_mode towards ap_long_entry.
 */
    .code16
    .p2align 4
    .globl platform_ap_trampoline, platform_ap_trampoline_end
platform_ap_trampoline:
    cli
    cld
    xorw %ax, %ax
    movw %ax, %ds
    lgdtl AP_T(ap_gdt_ptr)
    movl %cr0, %eax
    orl  $1, %eax                       /* PE */
    movl %eax, %cr0
    ljmpl $0x08, $AP_T(ap_protected)
    .code32
ap_protected:
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movl $(AP_BASE + 4096), %esp
    movl $ap_long_entry, %ebp
    movl $enter_long_mode, %eax
    jmp  *%eax
    .p2align 3
ap_gdt:
    .quad 0
    .quad 0x00cf9a000000ffff            /* 0x08: flat 32-bit code */
    .quad 0x00cf92000000ffff            /* 0x10: flat data */
ap_gdt_ptr:
    .word ap_gdt_ptr - ap_gdt - 1
    .long AP_T(ap_gdt)
platform_ap_trampoline_end:

    .code64
ap_long_entry:
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    xorw %ax, %ax
    movw %ax, %fs
    movw %ax, %gs
    movq platform_ap_stack(%rip), %rsp
    xorq %rbp, %rbp
    movl platform_ap_cpu(%rip), %edi
    call platform_ap_main
1:  cli
    hlt
    jmp 1b

    .text
/*
 * The way an idle core waits (platform_idle in smp.c): ring 3 executes HLT, which
 * raises #GP (CPL > 0) into ring 0 here, on the TSS stack with IF=0: the one way back
 * to ring 0 this host allows (its PVM answers INT n from guest ring 3 with #UD, and
 * SYSCALL does not reach ring 0 either; exceptions do). For a HLT from ring 3 this
 * steps over it and HLTs in ring 0. STI's one-instruction shadow covers HLT, so an
 * interrupt that became pending while ring 3 ran with IF=0 (the LAPIC timer armed
 * before, a wake IPI) ends the HLT at once instead of being lost; IRETQ restores
 * ring 3's IF=0. Any other #GP goes to platform_trap as before.
 * Frame: 0 saved rax, 8 error code, 16 rip, 24 cs, 32 rflags, 40 rsp, 48 ss.
 */
gp_or_idle:
    pushq %rax
    testb $3, 24(%rsp)
    jz   1f
    movq 16(%rsp), %rax
    cmpb $0xf4, (%rax)                  /* HLT */
    jne  1f
    incq 16(%rsp)
    popq %rax
    addq $8, %rsp
    sti
    hlt
    cli
    iretq
1:  popq %rax
    pushq $13
    jmp  trap_common

    .globl platform_wake_interrupt, platform_spurious_interrupt
/* The LAPIC timer and the wake IPI (WAKE_VECTOR): nothing to do but the EOI. */
platform_wake_interrupt:
    pushq %rax
    movq platform_lapic_eoi(%rip), %rax
    movl $0, (%rax)
    popq %rax
    iretq

/* A device's interrupt (DEVICE_VECTOR, core 0 only): a wake that is counted. */
    .globl platform_device_interrupt
platform_device_interrupt:
    pushq %rax
    incq platform_device_irqs(%rip)
    movq platform_lapic_eoi(%rip), %rax
    movl $0, (%rax)
    popq %rax
    iretq

/* The LAPIC's spurious vector: no EOI (SDM Vol. 3 §11.9). */
platform_spurious_interrupt:
    iretq

/*
 * void platform_enter_user(void (*fn)(void)): continue on the current stack in
 * ring 3 with IOPL 3 (port I/O still allowed) and interrupts off. See cpu.c.
 */
    .globl platform_enter_user
platform_enter_user:
    movq %rsp, %rax
    pushq $0x1b                         /* ss */
    pushq %rax                          /* rsp */
    pushq $0x3002                       /* rflags: IOPL=3, IF=0 */
    pushq $0x23                         /* cs */
    pushq %rdi                          /* rip */
    iretq

/* Exception entry stubs: push a dummy error code where the CPU does not,
 * then the vector, and hand the frame to platform_trap() (never returns). */
    .macro TRAP_STUB vec
trap_stub_\vec:
    .if \vec == 13
    jmp  gp_or_idle
    .exitm
    .endif
    .if (\vec == 8) || (\vec >= 10 && \vec <= 14) || (\vec == 17) || (\vec == 21) || (\vec == 29) || (\vec == 30)
    .else
    pushq $0
    .endif
    pushq $\vec
    jmp trap_common
    .endm

    .altmacro
    .set i, 0
    .rept 32
    TRAP_STUB %i
    .set i, i + 1
    .endr

trap_common:
    movq %rsp, %rdi
    andq $-16, %rsp
    call platform_trap
1:  jmp 1b

    .macro TRAP_ADDR vec
    .quad trap_stub_\vec
    .endm
    .section .rodata
    .p2align 3
    .globl platform_trap_stubs
platform_trap_stubs:
    .set i, 0
    .rept 32
    TRAP_ADDR %i
    .set i, i + 1
    .endr
    .noaltmacro

    .section .data
    .p2align 3
    .globl platform_gdt
platform_gdt:
boot_gdt:
    .quad 0
    .quad 0x00af9a000000ffff            /* 0x08: kernel 64-bit code */
    .quad 0x00cf92000000ffff            /* 0x10: kernel data */
    .quad 0x00cff2000000ffff            /* 0x18: user data (DPL 3) */
    .quad 0x00affa000000ffff            /* 0x20: user 64-bit code (DPL 3) */
    .quad 0, 0                          /* 0x28: TSS, filled in by cpu.c */
boot_gdt_end:
boot_gdt_ptr:
    .word boot_gdt_end - boot_gdt - 1
    .long boot_gdt

    .section .bss
    .p2align 12
boot_pml4:  .skip 4096
boot_pdpt:  .skip 4096
boot_pd:    .skip 4 * 4096
    .p2align 4
boot_stack: .skip STACK_SIZE
boot_stack_top:
