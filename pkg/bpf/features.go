package bpf

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"
)

// ClaimsUnsupported says why this kernel cannot run claim_slots (bpf/claim.c), or nil where it
// can: a syscall program calling bpf_loop and bpf_map_lookup_percpu_elem (Linux 5.19). Probed
// once, never read from the version. Where it cannot, the counters of new rules are zeroed by
// map updates: the same result, slower for large policies.
var ClaimsUnsupported = sync.OnceValue(func() error {
	for _, fn := range []asm.BuiltinFunc{asm.FnLoop, asm.FnMapLookupPercpuElem} {
		if err := features.HaveProgramHelper(ebpf.Syscall, fn); err != nil {
			return fmt.Errorf("syscall programs cannot call %s: %w", fn, err)
		}
	}
	return nil
})

// ClaimsFallback is how Info's Missing names a kernel without claim_slots (ClaimsUnsupported).
const ClaimsFallback = "bpf_loop and per-CPU map lookups in BPF programs (Linux 5.19): " +
	"new rules' counters are zeroed by map updates, slower for large policies"

// HeldRoomFallback is how Info's Missing names a kernel whose held fragments' room is
// preallocated (HeldRoomPreallocated).
const HeldRoomFallback = "map elements over 4 KiB allocated by BPF programs: " +
	"the room for held fragments is preallocated (2.4 MB per family at the default table sizes)"

// HeldRoomPreallocated says why the room for held fragments (frag_held_v4/v6, bpf/maps.h) is
// preallocated on this kernel, or nil where it is allocated as fragments are held: a program
// cannot add heldBurst elements of a held fragment's size in a row to a hash map that allocates
// its elements as they come (BPF_F_NO_PREALLOC), as the later fragments of a datagram may
// come. 6.1's allocator for such maps serves a few from a per-CPU cache, refilled later, and
// fails the rest. Probed once, by a program that tries.
var HeldRoomPreallocated = sync.OnceValue(func() error {
	value := uint32(unsafe.Sizeof(masqFragHeld{}))
	blank, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: value, MaxEntries: 1})
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer blank.Close()
	held, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: value, MaxEntries: heldBurst,
		Flags: unix.BPF_F_NO_PREALLOC})
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer held.Close()
	// v = lookup(blank, &0); for key = 0; key < heldBurst; key++ { if (r = update(held, &key, v, BPF_ANY)) return r }; return 0
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL", Instructions: asm.Instructions{
		asm.StoreImm(asm.R10, -4, 0, asm.Word),
		asm.Mov.Reg(asm.R2, asm.R10),
		asm.Add.Imm(asm.R2, -4),
		asm.LoadMapPtr(asm.R1, blank.FD()),
		asm.FnMapLookupElem.Call(),
		asm.JNE.Imm(asm.R0, 0, "found"),
		asm.Mov.Imm(asm.R0, -1),
		asm.Return(),
		asm.Mov.Reg(asm.R7, asm.R0).WithSymbol("found"),
		asm.Mov.Imm(asm.R6, 0),
		asm.StoreMem(asm.R10, -4, asm.R6, asm.Word).WithSymbol("loop"),
		asm.Mov.Reg(asm.R2, asm.R10),
		asm.Add.Imm(asm.R2, -4),
		asm.LoadMapPtr(asm.R1, held.FD()),
		asm.Mov.Reg(asm.R3, asm.R7),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnMapUpdateElem.Call(),
		asm.JNE.Imm(asm.R0, 0, "out"),
		asm.Add.Imm(asm.R6, 1),
		asm.JLT.Imm(asm.R6, heldBurst, "loop"),
		asm.Return().WithSymbol("out"),
	}})
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer prog.Close()
	ret, err := prog.Run(&ebpf.RunOptions{Data: make([]byte, 64)})
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	if r := int32(ret); r != 0 {
		return fmt.Errorf("a program cannot add %d elements of %d bytes in a row to a map without preallocation: %w",
			heldBurst, value, unix.Errno(-r))
	}
	return nil
})

// heldBurst is how many held fragments HeldRoomPreallocated's probe adds in a row: a datagram's
// whole room (FRAG_HELD_SLOTS).
const heldBurst = 64
