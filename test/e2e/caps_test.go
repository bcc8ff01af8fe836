package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"

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

// restricted returns an executable that runs the agent with only caps: the bounding set limits
// what a root process gets at exec, as a container runtime's capability list does.
func restricted(t *testing.T, caps []string) string {
	t.Helper()
	set := "-all"
	for _, c := range caps {
		set += ",+" + strings.ToLower(c)
	}
	path := filepath.Join(t.TempDir(), "agent-with-caps")
	script := fmt.Sprintf("#!/bin/sh\nexec setpriv --bounding-set=%s --inh-caps=-all -- %s \"$@\"\n", set, agentBin)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// effectiveCaps reads a process's effective capability set.
func effectiveCaps(t *testing.T, pid int) uint64 {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no CapEff")
	return 0
}

// The capabilities the DaemonSet lists are enough: with only them, the agent (as deployed, with
// --backend=auto) chooses the BPF datapath, becomes ready and masquerades. Without PERFMON the
// programs cannot load, and auto falls back to iptables, saying why.
func TestDaemonSetCapabilitiesAreEnough(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "setpriv", "iptables-nft-restore")
	if agentBin == "" {
		t.Fatal("no agent binary was built")
	}
	caps := daemonSetCapabilities(t)
	for _, tt := range []struct {
		name    string
		caps    []string
		backend string
	}{
		{"daemonset", caps, "bpf"},
		{"without-PERFMON", without(caps, "PERFMON"), "iptables"},
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
