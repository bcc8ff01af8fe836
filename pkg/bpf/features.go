package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
)

// ClaimsUnsupported says why this kernel cannot run claim_slots (bpf/claim.c), or nil where it
// can: a syscall program calling bpf_loop and bpf_map_lookup_percpu_elem (Linux 5.19). Probed
// once, never read from the version. Where it cannot, the counters of new rules are zeroed by
// map updates: the same result, slower for large policies.
var ClaimsUnsupported = sync.OnceValue(func() error {
	if err := raiseMemlock(); err != nil { // the probes load programs
		return err
	}
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
