package e2e

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"

	"github.com/cilium/ebpf"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// capabilityBits are the Linux capability numbers of the names a DaemonSet may list.
var capabilityBits = map[string]uint{"NET_ADMIN": 12, "NET_RAW": 13, "SYS_ADMIN": 21, "SYS_RESOURCE": 24, "PERFMON": 38, "BPF": 39}

// daemonSetCapabilities reads the capabilities the shipped DaemonSet adds (after dropping ALL).
func daemonSetCapabilities(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "deploy", "base", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict(data, &ds); err != nil {
		t.Fatal(err)
	}
	sc := ds.Spec.Template.Spec.Containers[0].SecurityContext
	if sc == nil || sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
		t.Fatalf("the DaemonSet does not drop ALL capabilities: %+v", sc)
	}
	var caps []string
	for _, c := range sc.Capabilities.Add {
		caps = append(caps, string(c))
	}
	return caps
}

// containerMemlock is the RLIMIT_MEMLOCK a container starts with: systemd's default for the
// container runtime's service (DefaultLimitMEMLOCK), which the runtime passes on.
const containerMemlock = 8 << 20

// restricted returns an executable that runs the agent with only caps: the bounding set limits
// what a root process gets at exec, as a container runtime's capability list does; and with a
// container's RLIMIT_MEMLOCK, which only CAP_SYS_RESOURCE may raise.
func restricted(t *testing.T, caps []string) string {
	t.Helper()
	set := "-all"
	for _, c := range caps {
		set += ",+" + strings.ToLower(c)
	}
	path := filepath.Join(t.TempDir(), "agent-with-caps")
	script := fmt.Sprintf("#!/bin/sh\nexec prlimit --memlock=%d:%d -- setpriv --bounding-set=%s --inh-caps=-all -- %s \"$@\"\n",
		containerMemlock, containerMemlock, set, agentBin)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// effectiveCaps reads a process's effective capability set.
func effectiveCaps(t *testing.T, pid int) uint64 { return capSet(t, fmt.Sprint(pid), "CapEff") }

// boundingCaps reads this process's bounding set: what its children may get at most.
func boundingCaps(t *testing.T) uint64 { return capSet(t, "self", "CapBnd") }

// capSet reads a capability set (CapEff, CapBnd, ...) of a process (a pid, or self).
func capSet(t *testing.T, pid, set string) uint64 {
	t.Helper()
	data, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, set+":"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no %s", set)
	return 0
}

// The capabilities the DaemonSet lists are enough: with only them, the agent (as deployed, with
// --backend=auto) chooses the BPF datapath, becomes ready and masquerades. Without PERFMON the
// programs cannot load, and auto falls back to iptables, saying why. On a kernel that charges
// BPF maps to RLIMIT_MEMLOCK (before 5.11) they are enough with SYS_RESOURCE, which the memlock
// overlay and the chart's memlock value add; without it, auto falls back and names the limit.
func TestDaemonSetCapabilitiesAreEnough(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "setpriv", "prlimit", "iptables-nft-restore")
	if agentBin == "" {
		t.Fatal("no agent binary was built")
	}
	caps := daemonSetCapabilities(t)
	withMemlock := append(slices.Clone(caps), "SYS_RESOURCE") // deploy/overlays/memlock
	daemonset, why := "bpf", ""
	if memlockCharged(t) {
		daemonset, why = "iptables", "RLIMIT_MEMLOCK"
	}
	for _, tt := range []struct {
		name    string
		caps    []string
		backend string
		why     string // what the log's reason for a fallback names
	}{
		{"daemonset", caps, daemonset, why},
		{"memlock-overlay", withMemlock, "bpf", ""},
		{"without-PERFMON", without(caps, "PERFMON"), "iptables", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			env := NewEnv(ctx, t, restricted(t, tt.caps), nil)
			b := BestBPFBackend()
			b.Prepare(ctx, t, env) // a bpffs of the test's own, given as --bpffs
			b.Flags = []string{"--backend=auto"}
			a := env.StartAgent(ctx, t, b)
			if err := a.WaitReady(ctx); err != nil {
				t.Fatalf("not ready with %v: %v\n%s", tt.caps, err, a.Logs())
			}

			var want uint64
			for _, c := range tt.caps {
				bit, ok := capabilityBits[c]
				if !ok {
					t.Fatalf("unknown capability %s", c)
				}
				want |= 1 << bit
			}
			// Less what this process cannot give (a sandbox may hold SYS_RESOURCE back).
			want &= boundingCaps(t)
			if got := effectiveCaps(t, a.Pid()); got != want {
				t.Errorf("the agent runs with capabilities %#x, want exactly %#x (%v)", got, want, tt.caps)
			}

			_, metrics, err := a.Get(ctx, "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			if info := grepLines(metrics, "ip_masq_agent_datapath_info{"); !strings.Contains(info, fmt.Sprintf(`backend=%q`, tt.backend)) {
				t.Errorf("backend is not %s:\n%s", tt.backend, grepLines(metrics, "datapath_info"))
			}
			if tt.backend == "iptables" && a.Count("the BPF datapath cannot run here") == 0 {
				t.Errorf("the fallback to iptables is not explained in the log:\n%s", a.Logs())
			}
			if tt.why != "" && a.Count(tt.why) == 0 {
				t.Errorf("the log does not name %s as the fallback's reason:\n%s", tt.why, a.Logs())
			}

			for _, c := range []struct {
				dst  string
				want Want
			}{{"8.8.8.8", Masq}, {"10.1.2.3", Keep}} {
				got, seen, err := env.Observe(ctx, "tcp", netip.MustParseAddr(c.dst))
				if err != nil {
					t.Fatal(err)
				}
				if got != c.want {
					t.Errorf("%s: the external host saw %s (%v), want %v", c.dst, seen, got, c.want)
				}
			}
		})
	}
}

// memlockProbeEnv makes the test binary answer memlockCharged's question and exit (TestMain).
const memlockProbeEnv = "IP_MASQ_AGENT_E2E_PROBE_MEMLOCK"

// memlockCharged tells whether the kernel charges BPF maps to RLIMIT_MEMLOCK (before 5.11, when
// they moved to the memory cgroup): the test binary, run again, creates a map under a zero limit
// (in a process of its own: the limit is the whole process's).
func memlockCharged(t *testing.T) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), memlockProbeEnv+"=1")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return false
	case errors.As(err, &exit) && exit.ExitCode() == memlockProbeCharged:
		return true
	}
	t.Fatalf("memlock probe: %v: %s", err, out)
	return false
}

// memlockProbeCharged is the probe's exit code for a kernel that charges RLIMIT_MEMLOCK.
const memlockProbeCharged = 3

// probeMemlock is the probe's process: it exits 0 where a map is created under a zero
// RLIMIT_MEMLOCK, memlockProbeCharged where the kernel refuses it for the limit.
func probeMemlock() int {
	if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: 0, Max: 0}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if errors.Is(err, unix.EPERM) {
		return memlockProbeCharged
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	m.Close()
	return 0
}

func without(caps []string, drop string) []string {
	var out []string
	for _, c := range caps {
		if c != drop {
			out = append(out, c)
		}
	}
	return out
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
