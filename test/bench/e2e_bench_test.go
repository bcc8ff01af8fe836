// Package bench holds the end-to-end benchmarks: pod -> node -> external host in throwaway
// namespaces, with no agent (the limit), the iptables, nftables and BPF backends. They run
// only with -bench (make bench) and write their results as JSON for the report generator in
// ./report; nothing here is a timed assertion.
package bench

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

var (
	outDir   = flag.String("out", "", "directory for the JSON results (default: a temp dir, printed)")
	runs     = flag.Int("runs", 5, "runs per measurement; the report uses the median")
	duration = flag.Duration("duration", 5*time.Second, "length of one load run")
	workers  = flag.Int("workers", 32, "concurrent connections of the short-connection load")
	only     = flag.String("modes", "", "comma-separated subset of modes to run (none,bpf,bpf-norandom,iptables,iptables-norandom,nftables,nftables-norandom)")
)

// target is the external host's address the load goes to: public, so the default policy
// masquerades it.
var target = netip.MustParseAddr("8.8.8.8")

const (
	connratePort = 7001
	iperfPort    = 5201
)

// Mode is one way of running the node.
type Mode struct {
	Name    string
	Backend *e2e.Backend // nil: no agent (the limit)
	// Flags are given to the agent beyond the backend's own.
	Flags []string
}

// agentBackend is the mode's backend with its flags.
func (m Mode) agentBackend() e2e.Backend {
	b := *m.Backend
	b.Flags = append(slices.Clone(b.Flags), m.Flags...)
	return b
}

func modes() []Mode {
	all := allModes()
	if *only == "" {
		return all
	}
	var out []Mode
	for _, m := range all {
		if slices.Contains(strings.Split(*only, ","), m.Name) {
			out = append(out, m)
		}
	}
	return out
}

// CIDR sets the load runs under: the defaults, and 10k non-masquerade CIDRs that the target
// lies outside of, so every new flow is checked against all of them before it is masqueraded.
var cidrSets = []int{0, 10000}

// BenchmarkEndToEnd runs every measurement once (use -benchtime=1x) and writes e2e.json.
func BenchmarkEndToEnd(b *testing.B) {
	testutil.RequirePrivileged(b, "ip", "iperf3", "iptables-nft-restore")
	bins := buildBinaries(b)
	res := &benchdata.Results{Machine: machine(), StartedAt: time.Now().UTC()}
	for range b.N {
		for _, n := range cidrSets {
			b.Run(fmt.Sprintf("load/cidrs=%d", n), func(b *testing.B) {
				load, cost := measureLoad(b, bins, modes(), n)
				res.Load, res.PacketCost = append(res.Load, load...), append(res.PacketCost, cost...)
			})
		}
		for _, m := range modes() {
			if m.Backend == nil || len(m.Flags) > 0 {
				continue
			}
			for _, n := range []int{10000, 100000} {
				b.Run(fmt.Sprintf("apply/%s/cidrs=%d", m.Name, n), func(b *testing.B) {
					res.Apply = append(res.Apply, measureApply(b, bins, m, n)...)
				})
			}
			b.Run("memory/"+m.Name, func(b *testing.B) {
				res.Memory = append(res.Memory, measureMemory(b, bins, m)...)
			})
		}
	}
	writeJSON(b, benchdata.E2EFile, res)
}

type binaries struct{ agent, connrate string }

func buildBinaries(b *testing.B) binaries {
	dir := b.TempDir()
	bins := binaries{agent: filepath.Join(dir, "ip-masq-agent"), connrate: filepath.Join(dir, "connrate")}
	for pkg, out := range map[string]string{"../../cmd/ip-masq-agent": bins.agent, "../bench/connrate": bins.connrate} {
		cmd := exec.Command("go", "build", "-o", out, pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if o, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("build %s: %v\n%s", pkg, err, o)
		}
	}
	return bins
}

func machine() benchdata.Machine {
	var u syscall.Utsname
	_ = syscall.Uname(&u)
	kernel := utsString(u.Release[:])
	cpu := ""
	if data, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if name, ok := strings.CutPrefix(line, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
				break
			}
		}
	}
	goVersion, _ := exec.Command("go", "env", "GOVERSION").Output()
	return benchdata.Machine{Kernel: kernel, CPUs: numCPU(), CPU: cpu, Go: strings.TrimSpace(string(goVersion))}
}

func utsString(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

// cidrConfig is a config with n non-masquerade /24s in 11.0.0.0/8 and beyond: none contains
// the target, so each new flow is masqueraded after every one of them was considered.
func cidrConfig(n int) string { return cidrConfigFrom(n, 0) }

// cidrConfigFrom is cidrConfig with the /24s numbered from first on.
func cidrConfigFrom(n, first int) string {
	if n == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "cidrLimit: %d\nnonMasqueradeCIDRs:\n", n)
	for i := first; i < first+n; i++ {
		fmt.Fprintf(&b, "  - %s\n", cidr24(i))
	}
	return b.String()
}

// cidr24 is the i-th /24 of the benchmarks' configs: 11.0.0.0/24 onwards, skipping nothing the
// topology uses (10/8 holds the node's uplink).
func cidr24(i int) string { return fmt.Sprintf("%d.%d.%d.0/24", 11+i/65536, (i/256)%256, i%256) }

// newEnv builds a topology whose node is like a kube-proxy node (conntrack in use) and writes a
// config with n CIDRs (none: the defaults).
func newEnv(ctx context.Context, b *testing.B, bins binaries, n int) *e2e.Env {
	b.Helper()
	env := e2e.NewEnv(ctx, b, bins.agent, nil)
	// Every mode runs on a node with kube-proxy's conntrack rule, as real nodes are.
	e2e.IptablesBackend(iptables.ModeNFT).Prepare(ctx, b, env)
	if cfg := cidrConfig(n); cfg != "" {
		if err := env.Config.Write(cfg); err != nil {
			b.Fatal(err)
		}
	}
	return env
}

// startMode starts the agent of mode (nothing for the limit) and waits until it is ready. The
// mode's Prepare runs once per topology (prepared records it).
func startMode(ctx context.Context, b *testing.B, env *e2e.Env, m Mode, prepared map[string]bool) {
	b.Helper()
	if m.Backend == nil {
		return
	}
	if m.Backend.Prepare != nil && !prepared[m.Backend.Name] && m.Backend.Name != e2e.IptablesBackend(iptables.ModeNFT).Name {
		m.Backend.Prepare(ctx, b, env)
		prepared[m.Backend.Name] = true
	}
	a := env.StartAgent(ctx, b, m.agentBackend())
	if err := a.WaitReady(ctx); err != nil {
		b.Fatalf("agent: %v\n%s", err, a.Logs())
	}
}

// stopMode stops the agent and removes what it installed, so the next mode starts clean.
func stopMode(ctx context.Context, b *testing.B, env *e2e.Env, m Mode) {
	b.Helper()
	if m.Backend == nil {
		return
	}
	if err := env.Agent.Stop(ctx); err != nil {
		b.Logf("agent exit: %v", err)
	}
	if _, err := e2e.NSExec(ctx, env.Node, "", env.Bin, env.DatapathArgs("cleanup", m.agentBackend())...); err != nil {
		b.Fatalf("cleanup: %v", err)
	}
}

// measureLoad measures every mode on one topology, interleaved run by run, so that whatever
// else the machine does in the meantime weighs on every mode alike; then, once more with the
// kernel's BPF statistics on, what the programs of the modes with a NAT table of their own
// cost per packet.
func measureLoad(b *testing.B, bins binaries, ms []Mode, n int) ([]benchdata.LoadResult, []benchdata.PacketCost) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	e := newEnv(ctx, b, bins, n)
	e2e.StartProcess(ctx, b, e.Ext, bins.connrate, "serve", "-listen", netip.AddrPortFrom(target, connratePort).String())
	e2e.StartProcess(ctx, b, e.Ext, "iperf3", "-s", "-B", target.String(), "-p", strconv.Itoa(iperfPort))
	e2e.WaitListening(ctx, b, e.Ext, netip.AddrPortFrom(target, connratePort))
	e2e.WaitListening(ctx, b, e.Ext, netip.AddrPortFrom(target, iperfPort))
	results := make([]benchdata.LoadResult, len(ms))
	for i, m := range ms {
		results[i] = benchdata.LoadResult{Mode: m.Name, CIDRs: n}
	}
	// A discarded warm-up: neighbour entries, page cache and CPU frequency settle first.
	connRate(ctx, b, bins, e)
	bulk(ctx, b, e)
	prepared := map[string]bool{}
	for run := range *runs {
		// Each run starts with another mode, so that none always follows the same one (the
		// iptables runs leave SYN retransmits and conntrack entries behind).
		for j := range ms {
			i := (j + run) % len(ms)
			m := ms[i]
			clearTimeWait(ctx, b, e.Ext)
			startMode(ctx, b, e, m, prepared)
			c := connRate(ctx, b, bins, e)
			tput := bulk(ctx, b, e)
			stopMode(ctx, b, e, m)
			r := &results[i]
			r.ConnRates, r.Slow, r.Errors = append(r.ConnRates, c.Rate), append(r.Slow, c.Slow), append(r.Errors, c.Errors)
			r.Connections, r.CPUSeconds = append(r.Connections, c.Connections), append(r.CPUSeconds, c.CPUSeconds)
			r.Throughputs = append(r.Throughputs, tput)
			r.SYNRetrans = append(r.SYNRetrans, c.SYNRetrans)
			b.Logf("%s cidrs=%d run %d: %.0f conn/s (%d slow, %d SYNs sent again, %d errors), %.2f CPU s per 100k connections, %.2f Gbit/s",
				m.Name, n, run+1, c.Rate, c.Slow, c.SYNRetrans, c.Errors, c.CPUSeconds/float64(max(c.Connections, 1))*1e5, tput/1e9)
		}
	}
	var costs []benchdata.PacketCost
	for _, m := range ms {
		if m.Backend != nil && m.Backend.NAT {
			costs = append(costs, measurePacketCost(ctx, b, bins, e, m, n, prepared)...)
		}
	}
	for _, r := range results {
		b.ReportMetric(median(r.ConnRates), r.Mode+"-conn/s")
		b.ReportMetric(median(r.Throughputs)/1e9, r.Mode+"-Gbit/s")
		var cpu []float64
		for i, c := range r.CPUSeconds {
			cpu = append(cpu, c/float64(max(r.Connections[i], 1))*1e5)
		}
		b.ReportMetric(median(cpu), r.Mode+"-cpus/100kconn")
	}
	return results, costs
}

// connRun is one run of the short-connection load.
type connRun struct {
	Rate        float64 `json:"rate"`
	Connections int64   `json:"connections"`
	Slow        int64   `json:"slow"`
	Errors      int64   `json:"errors"`
	FirstError  string  `json:"first_error"`
	CPUSeconds  float64 `json:"-"`
	SYNRetrans  int64   `json:"-"`
}

// connRate runs the short-connection load from the pod for one run, and reads the system and
// softirq time the machine spent meanwhile.
func connRate(ctx context.Context, b *testing.B, bins binaries, e *e2e.Env) connRun {
	b.Helper()
	synBefore := e2e.TCPExt(ctx, b, e.Pod, "TCPSynRetrans")
	before := kernelCPU(b)
	out, err := e2e.NSExec(ctx, e.Pod, "", bins.connrate, "run", "-target", netip.AddrPortFrom(target, connratePort).String(),
		"-workers", strconv.Itoa(*workers), "-duration", duration.String())
	if err != nil {
		b.Fatalf("connrate: %v", err)
	}
	cpu := kernelCPU(b) - before
	synRetrans := e2e.TCPExt(ctx, b, e.Pod, "TCPSynRetrans") - synBefore
	var r connRun
	if err := json.Unmarshal(out, &r); err != nil {
		b.Fatalf("connrate output %q: %v", out, err)
	}
	if r.FirstError != "" {
		b.Logf("connrate: %d errors, the first: %s", r.Errors, r.FirstError)
	}
	r.CPUSeconds, r.SYNRetrans = cpu, synRetrans
	return r
}

// clearTimeWait closes the TIME_WAIT sockets of namespace ns (the external host), so that
// every run starts with a far side that remembers no earlier run's connections. A mode's
// cleanup erases its NAT mappings while the server keeps their TIME_WAIT sockets for 60 s; the
// next mode's fresh mappings then land on those (address, port) pairs for other pod sockets.
// Timestamps are offset per connection, so such a SYN's is older than the one the TIME_WAIT
// socket holds about half the time: PAWS rejects it (the server's TcpExtPAWSTimewait), the
// server answers with a bare ACK, the pod resets and sends its SYN again some 10 ms later. The
// limit never meets them (the far side sees the pod's own address), so they would tax the NAT
// modes by the order they run in rather than by what they do.
func clearTimeWait(ctx context.Context, b *testing.B, ns string) {
	b.Helper()
	if out, err := e2e.NSExec(ctx, ns, "", "ss", "-K", "-tn", "state", "time-wait"); err != nil {
		b.Fatalf("close TIME_WAIT sockets in %s: %v\n%s", ns, err, out)
	}
	out, err := e2e.NSExec(ctx, ns, "", "ss", "-H", "-tn", "state", "time-wait")
	if err != nil {
		b.Fatalf("list TIME_WAIT sockets in %s: %v", ns, err)
	}
	if n := strings.Count(string(out), "\n"); n > 0 {
		b.Fatalf("%d TIME_WAIT sockets left in %s after ss -K (a kernel without CONFIG_INET_DIAG_DESTROY?)", n, ns)
	}
}

// clockTicks is USER_HZ, the unit of /proc/stat: 100 on every Linux architecture Go supports.
const clockTicks = 100

// kernelCPU is the system and softirq time all CPUs have spent since boot, in seconds, from the
// first line of /proc/stat ("cpu user nice system idle iowait irq softirq ...").
func kernelCPU(b *testing.B) float64 {
	b.Helper()
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		b.Fatalf("/proc/stat: unexpected first line %q", line)
	}
	var ticks uint64
	for _, i := range []int{3, 7} { // system, softirq
		n, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			b.Fatalf("/proc/stat: %q: %v", line, err)
		}
		ticks += n
	}
	return float64(ticks) / clockTicks
}

// bulk runs one iperf3 TCP stream from the pod and returns bits per second.
func bulk(ctx context.Context, b *testing.B, e *e2e.Env) float64 {
	b.Helper()
	out, err := e2e.NSExec(ctx, e.Pod, "", "iperf3", "-c", target.String(), "-p", strconv.Itoa(iperfPort),
		"-t", strconv.Itoa(max(1, int(duration.Seconds()))), "-J")
	if err != nil {
		b.Fatalf("iperf3: %v", err)
	}
	var r struct {
		End struct {
			SumReceived struct {
				BitsPerSecond float64 `json:"bits_per_second"`
			} `json:"sum_received"`
		} `json:"end"`
	}
	if err := json.Unmarshal(out, &r); err != nil {
		b.Fatalf("iperf3 output: %v", err)
	}
	return r.End.SumReceived.BitsPerSecond
}

// measureApply starts the agent with the defaults, writes a config with n CIDRs and times how
// long until the agent reports the datapath holds it (it logs after the backend's Apply
// returned); then it replaces them with n other CIDRs and times that too. The first includes
// whatever the backend does once for a larger policy (the BPF backend grows its rule maps); the
// second is a change of that size on a datapath sized for it. Both include the agent's debounce
// of directory events.
func measureApply(b *testing.B, bins binaries, m Mode, n int) []benchdata.ApplyResult {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	e := newEnv(ctx, b, bins, 0)
	startMode(ctx, b, e, m, map[string]bool{})
	var out []benchdata.ApplyResult
	for _, step := range []struct {
		kind  string
		first int
	}{{"first", 0}, {"replace", n}} {
		want := []string{"policy applied", fmt.Sprintf("ipv4Rules=%d ", n+2)}
		before := e.Agent.Count(want...)
		start := time.Now()
		if err := e.Config.Write(cidrConfigFrom(n, step.first)); err != nil {
			b.Fatal(err)
		}
		if err := e.Agent.WaitLog(ctx, before+1, want...); err != nil {
			b.Fatalf("apply of %d CIDRs: %v\n%s", n, err, e.Agent.Logs())
		}
		took := time.Since(start)
		b.Logf("%s: %d CIDRs (%s) live after %v", m.Name, n, step.kind, took)
		b.ReportMetric(took.Seconds()*1000, step.kind+"-ms")
		out = append(out, benchdata.ApplyResult{Mode: m.Name, CIDRs: n, Kind: step.kind, Seconds: took.Seconds()})
	}
	return out
}

// measureMemory reads the agent's resident memory idle, and with many NAT entries where the
// backend has a NAT table.
func measureMemory(b *testing.B, bins binaries, m Mode) []benchdata.MemResult {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	e := newEnv(ctx, b, bins, 0)
	startMode(ctx, b, e, m, map[string]bool{})
	time.Sleep(2 * time.Second) // past start-up allocations
	out := []benchdata.MemResult{{Mode: m.Name, State: "idle", RSSBytes: rss(b, e.Agent)}}
	b.Logf("%s idle: %d KiB", m.Name, out[0].RSSBytes/1024)
	if fill := natFiller(m); fill != nil {
		entries := fill(ctx, b, e)
		out = append(out, benchdata.MemResult{Mode: m.Name, State: "nat", RSSBytes: rss(b, e.Agent), NATEntries: entries})
		b.Logf("%s with %d NAT entries: %d KiB", m.Name, entries, out[1].RSSBytes/1024)
	}
	return out
}

// rss is the agent's resident memory, in bytes.
func rss(b *testing.B, a *e2e.Agent) int64 {
	b.Helper()
	n, err := a.RSS()
	if err != nil {
		b.Fatal(err)
	}
	return n
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func numCPU() int {
	data, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return 0
	}
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(string(data)), ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		l, _ := strconv.Atoi(lo)
		h := l
		if isRange {
			h, _ = strconv.Atoi(hi)
		}
		n += h - l + 1
	}
	return n
}
