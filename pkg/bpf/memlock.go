package bpf

import (
	"fmt"
	"sync"

	"github.com/cilium/ebpf/rlimit"
)

// raiseMemlock lifts RLIMIT_MEMLOCK where the kernel charges BPF maps and programs to it
// (before 5.11, when they moved to the memory cgroup); elsewhere it changes nothing. Which one
// the kernel does is probed (a map created under a zero limit), never read from its version.
// Raising the limit needs CAP_SYS_RESOURCE, which only such kernels ask of the agent.
var raiseMemlock = sync.OnceValue(func() error {
	if err := rlimit.RemoveMemlock(); err != nil {
		return fmt.Errorf("this kernel charges BPF maps to RLIMIT_MEMLOCK (Linux before 5.11), "+
			"and raising the limit failed: give the agent CAP_SYS_RESOURCE (docs/install.md, Kernels): %w", err)
	}
	return nil
})
