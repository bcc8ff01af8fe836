package e2e

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// agentBin is the agent binary under test, built once by TestMain (or given as
// $IP_MASQ_AGENT_BIN); empty when the privileged tests cannot run. connrateBin is the
// short-connection load tool of test/bench/connrate, built alongside.
var agentBin, connrateBin string

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	if os.Getenv(memlockProbeEnv) == "1" {
		return probeMemlock()
	}
	flag.Parse()
	// The tests' own BPF objects (neighbour programs, old layouts' pins), on a kernel that
	// charges them to RLIMIT_MEMLOCK (before 5.11); the agents lift theirs themselves.
	if os.Geteuid() == 0 {
		if err := rlimit.RemoveMemlock(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			return 1
		}
	}
	// Build only where the privileged tests will run; elsewhere they skip (or fail in CI) on
	// their own, without a binary.
	if os.Geteuid() == 0 && (!testing.Short() || testutil.InCI()) {
		dir, err := os.MkdirTemp("", "ip-masq-agent-e2e-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			return 1
		}
		defer os.RemoveAll(dir)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		build := func(out, pkg string) bool {
			cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if b, err := cmd.CombinedOutput(); err != nil {
				fmt.Fprintf(os.Stderr, "e2e: build %s: %v\n%s", pkg, err, b)
				return false
			}
			return true
		}
		// Prebuilt binaries (the kernel matrix's guests have no Go toolchain to spare) or built
		// here.
		if connrateBin = os.Getenv("IP_MASQ_AGENT_CONNRATE_BIN"); connrateBin == "" {
			connrateBin = filepath.Join(dir, "connrate")
			if !build(connrateBin, "github.com/ip-masq-agent/ip-masq-agent/test/bench/connrate") {
				return 1
			}
		}
		if bin := os.Getenv("IP_MASQ_AGENT_BIN"); bin != "" {
			// go test runs in the package directory, so a relative path would be misread.
			if !filepath.IsAbs(bin) {
				fmt.Fprintf(os.Stderr, "e2e: IP_MASQ_AGENT_BIN=%s must be an absolute path\n", bin)
				return 1
			}
			if _, err := os.Stat(bin); err != nil {
				fmt.Fprintln(os.Stderr, "e2e:", err)
				return 1
			}
			agentBin = bin
		} else {
			agentBin = filepath.Join(dir, "ip-masq-agent")
			if !build(agentBin, "github.com/ip-masq-agent/ip-masq-agent/cmd/ip-masq-agent") {
				return 1
			}
		}
	}
	return m.Run()
}

// backends are the datapaths the scenario table runs against (Backends).
func backends() []Backend { return Backends() }

func requireBackend(t *testing.T, b Backend) {
	t.Helper()
	testutil.RequirePrivileged(t, append([]string{"ip"}, b.Tools...)...)
	if agentBin == "" {
		t.Fatal("no agent binary was built")
	}
}

// TestScenarios runs the scenario table against every backend: the source address the external
// host sees, over TCP and UDP, IPv4 and IPv6, and the installed datapath read back after every
// step. Select one backend with -run 'TestScenarios/iptables-nft/'.
func TestScenarios(t *testing.T) {
	for _, b := range backends() {
		for _, sc := range Scenarios() {
			t.Run(b.Name+"/"+sc.Name, func(t *testing.T) {
				t.Parallel()
				requireBackend(t, b)
				Run(t, agentBin, b, sc)
			})
		}
	}
}

// TestLifecycle: SIGTERM leaves the datapath in place; a restart with a bad file keeps it and
// stays unready; cleanup removes everything for both families, twice without error.
func TestLifecycle(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		masqueraded := join(expect(Masq, "8.8.8.8", "2001:4860:4860::8888"), expect(Keep, "10.1.2.3", "fd00::1"))
		ag := env.StartReady(ctx, t, b, seedNodeIdentity)
		if code, body, err := ag.Get(ctx, "/healthz"); err != nil || code != http.StatusOK {
			t.Errorf("healthz = %d %q %v", code, body, err)
		}
		env.Check(ctx, t, masqueraded, nil)

		// SIGTERM: a clean exit, and the datapath stays.
		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}
		b.Verify(ctx, t, env)
		env.Check(ctx, t, masqueraded, nil)

		// A restart with a bad file: not ready, nothing changed, the old policy still works.
		if err := env.Config.Write("nonMasqueradeCIDRs: [10.0.0.0/33]\n"); err != nil {
			t.Fatal(err)
		}
		ag = env.StartAgent(ctx, t, b)
		if err := ag.WaitLog(ctx, 1, "config rejected"); err != nil {
			t.Fatal(err)
		}
		code, body, err := ag.WaitServing(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "10.0.0.0/33") {
			t.Errorf("readyz with only a bad file = %d %q, want 503 naming the bad value", code, body)
		}
		b.Verify(ctx, t, env)
		env.Check(ctx, t, masqueraded, nil)
		if err := ag.Stop(ctx); err != nil {
			t.Fatalf("agent exit after SIGTERM: %v", err)
		}

		// cleanup, without --enable-ipv6, removes IPv4 and IPv6; twice is fine. It gets the
		// backend's own flags (--bpffs), as a DaemonSet's cleanup would.
		for i := range 2 {
			args := append(append([]string{"cleanup"}, b.Flags...), env.AgentFlags...)
			out, err := NSExec(ctx, env.Node, "", agentBin, args...)
			if err != nil {
				t.Fatalf("cleanup #%d: %v", i+1, err)
			}
			t.Logf("cleanup #%d: %s", i+1, strings.TrimSpace(string(out)))
			b.Gone(ctx, t, env)
		}
		env.Check(ctx, t, expect(Keep, "8.8.8.8", "2001:4860:4860::8888"), nil)
	})
}

// TestBadConfigAtStartup: with only a bad file, the agent installs nothing and is not ready;
// the first good file is applied and makes it ready.
func TestBadConfigAtStartup(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		if err := env.Config.Write("masqOutBound: yes please\n"); err != nil {
			t.Fatal(err)
		}
		ag := env.StartAgent(ctx, t, b)
		if err := ag.WaitLog(ctx, 1, "config rejected"); err != nil {
			t.Fatal(err)
		}
		code, body, err := ag.WaitServing(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "yes please") {
			t.Errorf("readyz = %d %q, want 503 naming the bad value", code, body)
		}
		b.Gone(ctx, t, env)
		env.Check(ctx, t, expect(Keep, "8.8.8.8"), nil)

		if err := env.Config.Write("masqOutBound: true\n"); err != nil {
			t.Fatal(err)
		}
		env.SetGood("masqOutBound: true\n", false)
		if err := ag.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		env.Check(ctx, t, join(expect(Masq, "8.8.8.8"), expect(Keep, "10.1.2.3")), nil)
		b.Verify(ctx, t, env)
	})
}

// TestResyncHealsDrift: with the drift checks off, the datapath is damaged behind the agent's
// back; the periodic resync re-applies the policy, and the check before it counts the heals.
func TestResyncHealsDrift(t *testing.T) {
	const cfg = "resyncInterval: 1s\n"
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.AgentFlags = append(env.AgentFlags, "--drift-check-interval=0")
		ag := env.StartReady(ctx, t, b, cfg)
		env.Check(ctx, t, expect(Masq, "8.8.8.8"), nil)
		// Damage the datapath right after a resync, so that the next one is a whole interval
		// away while the damage is observed.
		resyncs := ag.Count("trigger=resync", "policy applied") + 1
		if err := ag.WaitLog(ctx, resyncs, "trigger=resync", "policy applied"); err != nil {
			t.Fatal(err)
		}
		b.Drift(ctx, t, env)
		if got, _, err := env.Observe(ctx, "tcp", netip.MustParseAddr("8.8.8.8")); err != nil || got != Keep {
			t.Fatalf("the drift did not take the policy out: %v %v", got, err)
		}
		if err := ag.WaitLog(ctx, resyncs+1, "trigger=resync", "policy applied"); err != nil {
			t.Fatal(err)
		}
		env.Check(ctx, t, join(expect(Masq, "8.8.8.8"), expect(Keep, "10.1.2.3")), nil)
		b.Verify(ctx, t, env)
		got := heals(ctx, t, ag)
		for _, k := range b.DriftWhat {
			if got[k] != 1 || ag.Count("drift healed", "trigger=resync", "what="+k+" ") != 1 {
				t.Errorf("heal of %s: counted %v, logged %d times by the resync; want once", k, got[k],
					ag.Count("drift healed", "trigger=resync", "what="+k+" "))
			}
		}
		if n := ag.Count("trigger=drift"); n != 0 {
			t.Errorf("%d log lines of drift checks although they are off", n)
		}
	})
}

// eachBackend runs body for every backend of bs, as a parallel subtest named after it: with the
// backend's tools required, ctx bounded by ScenarioTimeout and env the backend's topology
// (NewBackendEnv with the policy flags). Tests that need another bound or no env write their
// own loop.
func eachBackend(t *testing.T, bs []Backend, flags []string, body func(ctx context.Context, t *testing.T, b Backend, env *Env)) {
	t.Helper()
	for _, b := range bs {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			requireBackend(t, b)
			ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
			defer cancel()
			body(ctx, t, b, NewBackendEnv(ctx, t, b, flags))
		})
	}
}

// NewBackendEnv builds a topology for one test of backend b, with the scenario's policy flags,
// and readies the node for b (its Prepare).
func NewBackendEnv(ctx context.Context, t testing.TB, b Backend, flags []string) *Env {
	t.Helper()
	env := NewEnv(ctx, t, agentBin, flags)
	if b.Prepare != nil {
		b.Prepare(ctx, t, env)
	}
	return env
}
