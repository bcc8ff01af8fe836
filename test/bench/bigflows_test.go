package bench

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

var (
	bigFlows  = flag.Int("big-flows", 1_000_000, "connections BenchmarkMillionFlows fills the NAT table with")
	bigWindow = flag.Duration("big-window", time.Minute, "length of BenchmarkMillionFlows' steady-state windows")
	bigRuns   = flag.Int("big-runs", 3, "how many times BenchmarkMillionFlows times each short operation (scrape, dump)")
	bigFull   = flag.Int("big-full-windows", 3, "how many steady-state windows in a row BenchmarkMillionFlows measures with the table full")
)

// Sizes of BenchmarkMillionFlows: the confirmed table holds two entries per flow, so 1M flows
// need 2M entries; --nat-max-entries gives them 20% room (below the sweep's pressure mark, 90%),
// and the resize grows it by 60%.
const (
	bigTableRoom = 1.25
	bigResize    = 1.6
	// scrapeEvery is how often the steady windows scrape /metrics, as a Prometheus would.
	scrapeEvery = 15 * time.Second
)

// BenchmarkMillionFlows runs the BPF agent (tcx) with its NAT table sized for a million flows and
// measures, empty and then full (every flow an idle established TCP connection, written by the
// agent's own programs: see flowFiller): its CPU over a steady window, each /metrics scrape and
// sweep, `dump`, a restart (time to ready, entries kept) and a resize that carries the flows.
// Results go to bigflows.json in -out.
//
//	go test -run '^$' -bench MillionFlows -benchtime 1x ./test/bench -args -out DIR
func BenchmarkMillionFlows(b *testing.B) {
	testutil.RequirePrivileged(b, "ip")
	bins := buildBinaries(b)
	for range b.N {
		res := measureBigFlows(b, bins, *bigFlows)
		writeJSON(b, benchdata.BigFlowsFile, res)
		worst := res.Full.CPUSeconds
		for _, w := range res.FullAfter {
			worst = max(worst, w.CPUSeconds)
		}
		b.ReportMetric(res.Full.CPUSeconds/res.Window*100, "cpu-%-full")
		b.ReportMetric(worst/res.Window*100, "cpu-%-full-worst")
		b.ReportMetric(median(res.Full.ScrapeMs), "scrape-ms")
		b.ReportMetric(median(res.Full.SweepMs), "sweep-ms")
	}
}

func measureBigFlows(b *testing.B, bins binaries, flows int) benchdata.BigFlows {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Minute)
	defer cancel()
	res := benchdata.BigFlows{Flows: flows, NATMaxEntries: int(float64(2*flows) * bigTableRoom), Window: bigWindow.Seconds()}
	res.ResizeTo = int(float64(res.NATMaxEntries) * bigResize)
	env := e2e.NewEnv(ctx, b, bins.agent, nil)
	be := e2e.BPFBackend(tc.ModeTCX)
	be.Prepare(ctx, b, env)
	flags := env.AgentFlags
	// -v=4 logs each walk of the sweep with its duration.
	flags = append(flags, "--v=4")
	env.AgentFlags = append(flags, "--nat-max-entries="+strconv.Itoa(res.NATMaxEntries))
	env.SetGood("", true)
	start := func() float64 {
		t0 := time.Now()
		a := env.StartAgent(ctx, b, be)
		if err := a.WaitReady(ctx); err != nil {
			b.Fatalf("agent not ready: %v\n%s", err, a.Logs())
		}
		return time.Since(t0).Seconds()
	}
	start()
	time.Sleep(2 * time.Second) // past start-up
	res.Idle = steadyWindow(ctx, b, env.Agent)

	f := newFlowFiller(b, env)
	t0 := time.Now()
	if err := f.fill(env.Node, 0, flows, 2); err != nil {
		b.Fatal(err)
	}
	res.FillSeconds = time.Since(t0).Seconds()
	walksBefore := len(sweepTimes(env.Agent.Logs()))
	b.Logf("%d connections through the agent's programs in %.1f s", flows, res.FillSeconds)

	for range *bigRuns {
		t0 := time.Now()
		res.Entries, res.EntryStates = dumpEntries(ctx, b, env, be)
		res.DumpSeconds = append(res.DumpSeconds, time.Since(t0).Seconds())
	}
	if res.Entries < 2*flows {
		b.Fatalf("dump counts %d NAT entries for %d connections", res.Entries, flows)
	}
	res.KernelBytes = natKernelBytes(b, env.PinDir())
	res.Full = steadyWindow(ctx, b, env.Agent)
	for range *bigFull - 1 {
		res.FullAfter = append(res.FullAfter, steadyWindow(ctx, b, env.Agent))
	}
	// A walk of a full table is paced over a couple of minutes: every one since the fill.
	res.Full.SweepMs = sweepTimes(env.Agent.Logs())[walksBefore:]
	res.RSSBytes = rss(b, env.Agent)

	// Restarts over the full table, then resizes: grown, shrunk back, grown again; each carries
	// every entry (the shrunk table still has room for them).
	pinned := res.NATMaxEntries
	restart := func(max int) benchdata.Restart {
		if err := env.Agent.Stop(ctx); err != nil {
			b.Logf("agent exit: %v", err)
		}
		env.AgentFlags = append(slices.Clone(flags), "--nat-max-entries="+strconv.Itoa(max))
		t0 := time.Now()
		r := benchdata.Restart{NATMaxEntries: max, ReadySeconds: start()}
		if max != pinned {
			pinned = max
			// The migration's last pass follows the first apply: entries are all carried once
			// it logged.
			if err := env.Agent.WaitLog(ctx, 1, "migration finished"); err != nil {
				b.Fatalf("resize to %d: %v\n%s", max, err, env.Agent.Logs())
			}
			r.CarriedSeconds = time.Since(t0).Seconds()
		}
		r.Entries, _ = dumpEntries(ctx, b, env, be)
		return r
	}
	for range *bigRuns {
		res.Restart = append(res.Restart, restart(res.NATMaxEntries))
	}
	for i := range *bigRuns {
		size := res.ResizeTo
		if i%2 == 1 {
			size = res.NATMaxEntries
		}
		res.Resize = append(res.Resize, restart(size))
	}
	b.Logf("%+v", res)
	return res
}

// steadyWindow measures the agent over -big-window: its CPU time, a timed scrape every
// scrapeEvery, and the sweeps it logged meanwhile.
func steadyWindow(ctx context.Context, b *testing.B, a *e2e.Agent) benchdata.SteadyPart {
	b.Helper()
	var part benchdata.SteadyPart
	sweepsBefore := len(sweepTimes(a.Logs()))
	before, err := a.CPUTime()
	if err != nil {
		b.Fatal(err)
	}
	end := time.Now().Add(*bigWindow)
	for next := time.Now(); time.Now().Before(end); next = next.Add(scrapeEvery) {
		time.Sleep(time.Until(next))
		t0 := time.Now()
		code, _, err := a.Get(ctx, "/metrics")
		if err != nil || code != 200 {
			b.Fatalf("scrape: %d %v", code, err)
		}
		part.ScrapeMs = append(part.ScrapeMs, float64(time.Since(t0).Microseconds())/1000)
	}
	time.Sleep(time.Until(end))
	after, err := a.CPUTime()
	if err != nil {
		b.Fatal(err)
	}
	part.CPUSeconds = (after - before).Seconds()
	part.SweepMs = sweepTimes(a.Logs())[sweepsBefore:]
	return part
}

var sweepLine = regexp.MustCompile(`msg="NAT (?:sweep|walk)".* took=([0-9.]+[µnm]?s)`)

// sweepTimes are the durations of the sweeps the agent logged, in ms.
func sweepTimes(logs string) []float64 {
	var out []float64
	for _, m := range sweepLine.FindAllStringSubmatch(logs, -1) {
		if d, err := time.ParseDuration(m[1]); err == nil {
			out = append(out, float64(d.Microseconds())/1000)
		}
	}
	return out
}

var dumpRow = regexp.MustCompile(`(?m)^(ipv[46])\s+(\S+)\s+(\S+)\s+(\d+)$`)

// dumpEntries runs `dump` in the node and returns the NAT entries it counted, in all and by
// "family/protocol/state".
func dumpEntries(ctx context.Context, b *testing.B, env *e2e.Env, be e2e.Backend) (int, map[string]int) {
	b.Helper()
	out, err := e2e.NSExec(ctx, env.Node, "", env.Bin, env.DatapathArgs("dump", be)...)
	if err != nil {
		b.Fatalf("dump: %v\n%s", err, out)
	}
	total, states := 0, map[string]int{}
	for _, m := range dumpRow.FindAllStringSubmatch(string(out), -1) {
		n, _ := strconv.Atoi(m[4])
		states[m[1]+"/"+m[2]+"/"+m[3]] += n
		total += n
	}
	return total, states
}

// natKernelBytes is the kernel's memory of each pinned NAT map under dir, as fdinfo reports it.
func natKernelBytes(b *testing.B, dir string) map[string]int64 {
	b.Helper()
	out := map[string]int64{}
	for _, name := range []string{"nat_v4", "nat_new_v4", "keep_v4", "inbound_v4", "nat_v6", "nat_new_v6", "keep_v6", "inbound_v6"} {
		n, err := pinnedMapMemory(filepath.Join(dir, name))
		if err != nil {
			b.Fatal(err)
		}
		out[name] = n
	}
	return out
}

func writeJSON(b *testing.B, name string, v any) {
	b.Helper()
	dir := *outDir
	if dir == "" {
		dir = b.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		b.Fatal(err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, data, 0o644); err != nil {
		b.Fatal(err)
	}
	b.Logf("results: %s", path)
}

// fdinfoMemlock reads the memlock line of a map's fdinfo: its kernel memory, as the kernel
// accounts it (the map type's own estimate, since 6.4 what it really allocated).
func fdinfoMemlock(fd int) (int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "memlock:"); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no memlock in fdinfo %d", fd)
}

// pinnedMapMemory is the kernel memory of the map pinned at path.
func pinnedMapMemory(path string) (int64, error) {
	m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0, err
	}
	defer m.Close()
	return fdinfoMemlock(m.FD())
}
