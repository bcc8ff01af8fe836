package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf/rlimit"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/sandbox"
)

// raiseMemlock lifts RLIMIT_MEMLOCK where the kernel charges BPF maps and programs to it
// (before 5.11, when they moved to the memory cgroup); elsewhere it changes nothing. Which one
// the kernel does is probed (a map created under a zero limit), never read from its version.
// Raising the limit needs CAP_SYS_RESOURCE, which only such kernels ask of the agent.
//
// The probe cannot tell that kernel from a sandbox that refuses bpf(2) before the kernel sees
// it: there, the error is left to the load that fails, which sandbox.ExplainBPF explains.
var raiseMemlock = sync.OnceValue(func() error {
	err := rlimit.RemoveMemlock()
	if err == nil || sandbox.BPFDenied() != nil {
		return nil
	}
	return fmt.Errorf("this kernel charges BPF maps to RLIMIT_MEMLOCK (Linux before 5.11), "+
		"and raising the limit failed: give the agent CAP_SYS_RESOURCE (docs/install.md, Kernels): %w", err)
})
