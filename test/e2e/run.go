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
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// ScenarioTimeout bounds one scenario, so that its cleanups run long before go test's own
// timeout would kill the binary without them: 90 s, times TimeoutScaleEnv.
var ScenarioTimeout = Scaled(90 * time.Second)

// TimeoutScaleEnv multiplies the suite's timeouts, and the limits it holds the agent's reactions
// to (HealLimit, the node lock's takeover, LiveChangeDeadline, a bypass's report), where
// everything runs several times slower: the kernel matrix's guests, emulated in QEMU
// (test/kernels sets it). What the tests assert of the datapath does not change; the limits
// themselves are held on the host's run.
const TimeoutScaleEnv = "IP_MASQ_AGENT_E2E_TIMEOUT_SCALE"

// Scaled is d times TimeoutScaleEnv: the suite's timeouts and limits, and those of the suites
// built on this one (the demo), where everything runs slower.
func Scaled(d time.Duration) time.Duration {
	if n, err := strconv.Atoi(os.Getenv(TimeoutScaleEnv)); err == nil && n > 1 {
		return d * time.Duration(n)
	}
	return d
}

// LiveChangeDeadline is how long a live config change may take, file written to traffic
// changed, before the scenario fails: a liveness bound, far above the speed target. How fast a
// change goes live is the benchmarks' to measure (make bench, "Config apply latency"); a
// scenario only logs what it saw, which on a loaded machine is mostly the probe's wait for a
// core.
var LiveChangeDeadline = Scaled(10 * time.Second)

// Backend says how to run the agent with one datapath and how to check what it installed. The
// scenario table is the same for every backend.
type Backend struct {
	// Name names the backend in subtest names, e.g. "iptables".
	Name string
	// Flags select the backend on the agent's command line, e.g. --backend=iptables.
	Flags []string
	// Tools must be on PATH for the backend's tests.
	Tools []string
	// Iptables is the iptables variant of the node's other tenants (kube-proxy's iptables
	// mode): the backend's own for the iptables backends, else nft.
	Iptables iptables.Mode
	// Prepare, when set, readies the node before the agent starts.
	Prepare func(ctx context.Context, t testing.TB, env *Env)
	// Verify checks that what the agent installed in the node equals the policy of env's last
	// good configuration.
	Verify func(ctx context.Context, t testing.TB, env *Env)
	// Gone checks that nothing of the backend is left in the node.
	Gone func(ctx context.Context, t testing.TB, env *Env)
	// Drift damages the installed datapath behind the agent's back, as an admin or another
	// agent might; the periodic resync must repair it. DriftWhat are the kinds of drift (the
	// heals metric's what) it causes.
	Drift     func(ctx context.Context, t testing.TB, env *Env)
	DriftWhat []string
	// Damages are the ways, one at a time, of changing what the backend installed that its drift
	// check must find and the agent repair.
	Damages []Damage
	// Refusals reads how many new flows the node refused for want of a source port so far (the
	// agent's no_port drops on BPF; conntrack's failed insertions on iptables, where NAT is
	// conntrack's).
	Refusals func(ctx context.Context, t testing.TB, env *Env) float64
	// FastExpiry makes closed flows give their ports back within about a second (the BPF
	// sweep's flags; conntrack's timeouts in the node).
	FastExpiry func(ctx context.Context, t testing.TB, env *Env)
	// Info is what the backend's ip_masq_agent_datapath_info says (its backend and attach_mode
	// labels).
	Info datapath.Info
	// NAT says whether the backend has a NAT table of its own and exports its metrics.
	NAT bool
}

// Damage is one change to the installed datapath behind the agent's back.
type Damage struct {
	Name string
	// What are the kinds of drift (the heals metric's what) the damage is, in DriftKinds order.
	What []string
	// Do damages the datapath; Repaired reports whether what Do damaged is back as the agent
	// installed it (it may fail the test on errors, not on a damage still in place).
	Do       func(ctx context.Context, t testing.TB, env *Env)
	Repaired func(ctx context.Context, t testing.TB, env *Env) bool
}

// Env is one scenario's world.
type Env struct {
	*Topology
	Bin   string
	Agent *Agent
	// Flags are the scenario's policy flags.
	Flags []string
	// AgentFlags are datapath flags a backend's Prepare adds (such as --bpffs): given to the
	// agent, dump and cleanup, not to render.
	AgentFlags []string
	// Config is the file's directory. With Dir set, the agent is given the directory itself,
	// whose files it merges.
	Config *ConfigDir
	Dir    bool
	// Good is the content of the last good configuration, GoodNoFile true when that was no file;
	// GoodFiles, when set, are the files of the last good config directory instead.
	Good       string
	GoodNoFile bool
	GoodFiles  map[string]string
}

// NewEnv builds a topology for one test.
func NewEnv(ctx context.Context, t testing.TB, bin string, flags []string) *Env {
	t.Helper()
	return &Env{Topology: NewTopology(ctx, t), Bin: bin, Flags: flags, Config: NewConfigDir(t)}
}

// StartReady writes cfg as the config file, records it as the good configuration, starts the
// agent for backend b and waits until it is ready.
func (e *Env) StartReady(ctx context.Context, t testing.TB, b Backend, cfg string) *Agent {
	t.Helper()
	if err := e.Config.Write(cfg); err != nil {
		t.Fatal(err)
	}
	e.SetGood(cfg, false)
	return e.startReady(ctx, t, b)
}

// StartReadyNoFile starts the agent for backend b without a config file (the defaults apply),
// records that as the good configuration and waits until it is ready.
func (e *Env) StartReadyNoFile(ctx context.Context, t testing.TB, b Backend) *Agent {
	t.Helper()
	e.SetGood("", true)
	return e.startReady(ctx, t, b)
}

func (e *Env) startReady(ctx context.Context, t testing.TB, b Backend) *Agent {
	t.Helper()
	a := e.StartAgent(ctx, t, b)
	if err := a.WaitReady(ctx); err != nil {
		t.Fatalf("agent not ready: %v", err)
	}
	// Readiness can be seen before the log line of the apply that made it: tests that count
	// "policy applied" lines from here on must find it counted already.
	if err := a.WaitLog(ctx, 1, "policy applied"); err != nil {
		t.Fatalf("agent ready, but its first apply is not in its log: %v", err)
	}
	return a
}

// StartAgent runs the agent for backend b in the node with the env's flags and config.
func (e *Env) StartAgent(ctx context.Context, t testing.TB, b Backend) *Agent {
	t.Helper()
	config := e.Config.Path()
	if e.Dir {
		config = e.Config.Dir
	}
	args := append(append(append([]string{"--config=" + config}, b.Flags...), e.AgentFlags...), e.Flags...)
	e.Agent = StartAgent(ctx, t, e.Node, e.Bin, args...)
	return e.Agent
}

// SetGood records the configuration the datapath must now implement.
func (e *Env) SetGood(content string, noFile bool) {
	e.Good, e.GoodNoFile, e.GoodFiles = content, noFile, nil
}

// setGoodStep records a step's configuration as the one the datapath must now implement.
func (e *Env) setGoodStep(st Step) {
	e.SetGood(st.Config, st.NoFile)
	e.GoodFiles = st.Files
}

// publish publishes a step's configuration: its file, or the files of its directory.
func (e *Env) publish(st Step) error {
	if st.Files != nil {
		return e.Config.WriteFiles(st.Files)
	}
	return e.Config.Write(st.Config)
}

// GoodConfig writes the last good configuration afresh, as a file or a directory, and returns
// its path: what `render` and the policy compiled here read.
func (e *Env) GoodConfig(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if e.GoodFiles != nil {
		for name, content := range e.GoodFiles {
			write(name, content)
		}
		return dir
	}
	if !e.GoodNoFile {
		write("good", e.Good)
	}
	return filepath.Join(dir, "good")
}

// Render runs `render` with args and the env's policy flags on the last good configuration:
// what the backend must have installed (without args, the iptables payload). render applies
// nothing.
func (e *Env) Render(ctx context.Context, t testing.TB, args ...string) string {
	t.Helper()
	out, err := run(ctx, "", e.Bin, append(append([]string{"render", "--config=" + e.GoodConfig(t)}, args...), e.Flags...)...)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	return string(out)
}

// DatapathArgs are the arguments of a subcommand that reads or changes the datapath (dump,
// cleanup) for backend b: the agent's flags, without its config.
func (e *Env) DatapathArgs(cmd string, b Backend) []string {
	return append(append(append([]string{cmd}, b.Flags...), e.AgentFlags...), e.Flags...)
}

// FlagSet reports whether a boolean --name flag of the env is set.
func (e *Env) FlagSet(name string) bool {
	for _, f := range e.Flags {
		if f == "--"+name || f == "--"+name+"=true" {
			return true
		}
	}
	return false
}

// FlagValue returns the value of a --name=value flag of the env, or def.
func (e *Env) FlagValue(name, def string) string {
	v := def
	for _, f := range e.Flags {
		if s, ok := strings.CutPrefix(f, "--"+name+"="); ok {
			v = s
		}
	}
	return v
}

// Observe probes dst over proto and classifies the source the external host saw.
func (e *Env) Observe(ctx context.Context, proto string, dst netip.Addr) (Want, netip.AddrPort, error) {
	src, err := e.Probe(ctx, proto, dst)
	if err != nil {
		return 0, src, err
	}
	fam := policy.FamilyOf(dst)
	switch src.Addr() {
	case NodeAddr(fam):
		return Masq, src, nil
	case NodeAlt(fam):
		return Alt, src, nil
	case PodAddr(fam):
		return Keep, src, nil
	}
	return 0, src, fmt.Errorf("%s to %s: source %s is neither the pod's nor one of the node's addresses", proto, dst, src)
}

// Check probes every expectation over TCP and UDP and reports each mismatch.
func (e *Env) Check(ctx context.Context, t testing.TB, expects []Expect, masqPorts *policy.PortRange) {
	t.Helper()
	for _, ex := range expects {
		dst := netip.MustParseAddr(ex.Dst)
		for _, proto := range []string{"tcp", "udp"} {
			got, src, err := e.Observe(ctx, proto, dst)
			if err != nil {
				t.Errorf("%v", err)
				continue
			}
			if got != ex.Want {
				t.Errorf("%s to %s: external host saw %s (%s), want %s", proto, dst, src, got, ex.Want)
				continue
			}
			if got != Keep && masqPorts != nil && (src.Port() < masqPorts.First || src.Port() > masqPorts.Last) {
				t.Errorf("%s to %s: masqueraded to port %d, outside %s", proto, dst, src.Port(), masqPorts)
			}
		}
	}
}

// Run runs one scenario against one backend.
func Run(t *testing.T, bin string, b Backend, sc Scenario) {
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	t.Cleanup(cancel)
	env := NewEnv(ctx, t, bin, sc.Flags)
	env.Dir = sc.Dir
	if sc.Alt {
		if err := env.AddAltAddresses(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if b.Prepare != nil {
		b.Prepare(ctx, t, env)
	}
	first := sc.Steps[0]
	if !first.NoFile {
		if err := env.publish(first); err != nil {
			t.Fatal(err)
		}
	}
	env.setGoodStep(first)
	ag := env.StartAgent(ctx, t, b)
	if err := ag.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	for i, st := range sc.Steps {
		if i > 0 {
			applyStep(ctx, t, env, sc.Steps[i-1], st)
			if t.Failed() {
				return
			}
		}
		env.Check(ctx, t, st.Expect, sc.MasqPorts)
		b.Verify(ctx, t, env)
		if t.Failed() {
			t.Fatalf("step %d failed", i+1)
		}
	}
}

// applyStep publishes a step's file while the agent runs and waits until the agent acted on it:
// for a bad file, until it logged the rejection; for a good one, until traffic changed (within
// LiveChangeDeadline; the time is logged).
func applyStep(ctx context.Context, t *testing.T, env *Env, prev, st Step) {
	t.Helper()
	ag := env.Agent
	if st.Bad {
		mention := append([]string{"config rejected"}, st.LogMentions...)
		rejected := ag.Count("config rejected")
		mentioned := ag.Count(mention...)
		if err := env.publish(st); err != nil {
			t.Fatal(err)
		}
		if err := ag.WaitLog(ctx, rejected+1, "config rejected"); err != nil {
			t.Fatal(err)
		}
		if len(st.LogMentions) == 0 || ag.Count(mention...) <= mentioned {
			t.Errorf("the rejection does not mention %q", st.LogMentions)
		}
		return
	}
	// A destination whose outcome this change flips shows when the change took effect.
	var sentinel *Expect
	for _, ex := range st.Expect {
		for _, old := range prev.Expect {
			if old.Dst == ex.Dst && old.Want != ex.Want {
				sentinel = &ex
				break
			}
		}
		if sentinel != nil {
			break
		}
	}
	if sentinel == nil {
		t.Fatalf("scenario error: a live change must flip at least one destination of the previous step")
	}
	// The reload may come from the file's event or from another that reads the file again
	// (an uplink's address event, at the agent's start).
	reloads := func() int {
		return ag.Count("trigger=config-change", "policy applied") + ag.Count("trigger=address-change", "policy applied")
	}
	applied := reloads()
	dst := netip.MustParseAddr(sentinel.Dst)
	start := time.Now()
	if err := env.publish(st); err != nil {
		t.Fatal(err)
	}
	var probeErrs []error
	dctx, dcancel := context.WithDeadline(ctx, start.Add(LiveChangeDeadline))
	defer dcancel()
	if err := testutil.PollContext(dctx, time.Millisecond, func() error {
		got, _, err := env.Observe(ctx, "tcp", dst)
		if err == nil && got == sentinel.Want {
			return nil
		}
		if err != nil {
			probeErrs = append(probeErrs, err)
		}
		return testutil.NotYet("tcp to %s still %s (%v)", dst, got, err)
	}); err != nil {
		t.Fatalf("the change did not take effect within %v: %v; probe errors meanwhile: %v", time.Since(start), err, probeErrs)
	}
	t.Logf("live config change: file written to traffic changed (tcp to %s %s) in %v; probe errors meanwhile: %v",
		dst, sentinel.Want, time.Since(start), probeErrs)
	// The change came through the agent's reload (whose log line follows the apply by a hair).
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	defer wcancel()
	if err := testutil.PollContext(wctx, 10*time.Millisecond, func() error {
		if n := reloads(); n <= applied {
			return testutil.NotYet("%d applies of a reload", n-applied)
		}
		return nil
	}); err != nil {
		t.Errorf("traffic changed but the agent logged no apply of a reload (config-change or address-change): %v", err)
	}
	env.setGoodStep(st)
}
