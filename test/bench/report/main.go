// Command report turns the benchmark results of `make bench` into docs/benchmarks.md and PNG
// plots (drawn with gnuplot).
//
//	report -in DIR -docs docs
//
// DIR holds micro.txt (the output of the BPF_PROG_TEST_RUN benchmarks of pkg/bpf), e2e.json
// (written by BenchmarkEndToEnd in test/bench) and iptables-control.txt (BenchmarkControlPlane of
// pkg/iptables, several counts), the big-node results (bignode.go) and kernels.txt (test/kernels'
// BenchmarkKernels: kernels.go). Without e2e.json, the big-node and per-kernel sections alone are
// written, into the report as it is.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
)

func main() {
	in := flag.String("in", "bin/bench", "directory with micro.txt and e2e.json")
	docs := flag.String("docs", "docs", "where benchmarks.md and the plots go")
	flag.Parse()
	if err := run(*in, *docs); err != nil {
		fmt.Fprintln(os.Stderr, "report:", err)
		os.Exit(1)
	}
}

// results is BenchmarkEndToEnd's, with the figures the report derives from it.
type results benchdata.Results

// micro maps benchmark name -> CIDR count -> ns per packet (the median of the runs).
type micro map[string]map[int]float64

// microRuns holds every run's value of micro (make bench runs them with -count).
type microRuns map[string]map[int][]float64

func (r microRuns) add(key string, n int, v float64) {
	if r[key] == nil {
		r[key] = map[int][]float64{}
	}
	r[key][n] = append(r[key][n], v)
}

var benchLine = regexp.MustCompile(`^Benchmark(\w+)/cidrs=(\d+)(?:-\d+)?\s+\d+\s+.*?([\d.]+) ns/pkt`)

// floorKey holds, at CIDR count 0, BenchmarkTestRunFloor's ns/pkt: an empty program's, what the
// test run itself adds to every other figure.
const floorKey = "TestRunFloor"

var floorLine = regexp.MustCompile(`^BenchmarkTestRunFloor(?:-\d+)?\s+\d+\s+.*?([\d.]+) ns/pkt`)

// connLine is BenchmarkConnection's: a "<ns> <step>-ns" metric per packet of one short
// connection and "<ns> ns/conn", their sum. Its steps go into micro as connKey(step).
var (
	connLine   = regexp.MustCompile(`^BenchmarkConnection/cidrs=(\d+)(?:-\d+)?\s+\d+\s+(.*)$`)
	metricPair = regexp.MustCompile(`([\d.]+) (\S+)`)
)

func connKey(step string) string { return "Connection:" + step }

// connSteps are BenchmarkConnection's steps in the order the packets go.
var connSteps = []struct{ key, title string }{
	{"syn", "pod SYN (new flow)"}, {"synack", "SYN-ACK (first reply)"}, {"ack", "pod ACK (flow confirmed)"},
	{"request", "pod request"}, {"response", "response"}, {"server-fin", "server FIN"},
	{"pod-fin", "pod FIN"}, {"last-ack", "last ACK"},
}

func readMicro(path string) (micro, microRuns, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	runs := microRuns{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if g := floorLine.FindStringSubmatch(sc.Text()); g != nil {
			v, _ := strconv.ParseFloat(g[1], 64)
			runs.add(floorKey, 0, v)
			continue
		}
		if g := connLine.FindStringSubmatch(sc.Text()); g != nil {
			n, _ := strconv.Atoi(g[1])
			for _, mp := range metricPair.FindAllStringSubmatch(g[2], -1) {
				v, _ := strconv.ParseFloat(mp[1], 64)
				key := ""
				if step, ok := strings.CutSuffix(mp[2], "-ns"); ok {
					key = connKey(step)
				} else if mp[2] == "ns/conn" {
					key = connKey("total")
				}
				if key != "" {
					runs.add(key, n, v)
				}
			}
			continue
		}
		g := benchLine.FindStringSubmatch(sc.Text())
		if g == nil {
			continue
		}
		n, _ := strconv.Atoi(g[2])
		v, _ := strconv.ParseFloat(g[3], 64)
		runs.add(g[1], n, v)
	}
	m := micro{}
	for key, byN := range runs {
		m[key] = map[int]float64{}
		for n, vs := range byN {
			m[key][n] = median(vs)
		}
	}
	return m, runs, sc.Err()
}

// control maps mode -> operation -> the ms per operation of each run, and commands per operation.
type control struct {
	ms       map[string]map[string][]float64
	commands map[string]map[string]float64
}

var controlLine = regexp.MustCompile(`^BenchmarkControlPlane/mode=(\w+)/([\w-]+?)(?:-\d+)?\s+\d+\s+([\d.]+) ns/op\s+([\d.]+) commands/op`)

// readControl reads BenchmarkControlPlane's output; a missing file is no control section.
func readControl(path string) (*control, error) {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	c := &control{ms: map[string]map[string][]float64{}, commands: map[string]map[string]float64{}}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		g := controlLine.FindStringSubmatch(sc.Text())
		if g == nil {
			continue
		}
		ns, _ := strconv.ParseFloat(g[3], 64)
		cmds, _ := strconv.ParseFloat(g[4], 64)
		if c.ms[g[1]] == nil {
			c.ms[g[1]], c.commands[g[1]] = map[string][]float64{}, map[string]float64{}
		}
		c.ms[g[1]][g[2]] = append(c.ms[g[1]][g[2]], ns/1e6)
		c.commands[g[1]][g[2]] = cmds
	}
	return c, sc.Err()
}

// spread is the min, median and max of xs.
func spread[T int64 | float64](xs []T) (lo, mid, hi T) {
	if len(xs) == 0 {
		return 0, 0, 0
	}
	return slices.Min(xs), median(xs), slices.Max(xs)
}

func median[T int64 | float64](xs []T) T {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func run(in, docs string) error {
	bn, err := readBigNode(in)
	if err != nil {
		return fmt.Errorf("big-node results: %w", err)
	}
	// The report as it is: the big-node sections of results this run lacks are kept from it.
	path := filepath.Join(docs, "benchmarks.md")
	doc, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	var big bytes.Buffer
	if !bn.empty() || bytes.Contains(doc, []byte(bigBegin)) {
		for _, note := range writeBigNode(&big, bn, doc) {
			fmt.Fprintln(os.Stderr, "report:", note)
		}
	}
	kernels, err := readKernels(filepath.Join(in, "kernels.txt"))
	if err != nil {
		return fmt.Errorf("per-kernel results: %w", err)
	}
	// The big-node or per-kernel benchmarks alone: their sections replace those of the report as
	// it is.
	if _, err := os.Stat(filepath.Join(in, benchdata.E2EFile)); errors.Is(err, fs.ErrNotExist) && (!bn.empty() || len(kernels) > 0) {
		if doc == nil {
			return fmt.Errorf("%s: %w (the big-node and per-kernel results alone go into the report as it is)", path, fs.ErrNotExist)
		}
		if !bn.empty() {
			doc = splice(doc, big.Bytes())
		}
		return os.WriteFile(path, spliceKernels(doc, doc, kernels), 0o644)
	}
	m, mr, err := readMicro(filepath.Join(in, "micro.txt"))
	if err != nil {
		return fmt.Errorf("micro benchmarks: %w", err)
	}
	data, err := os.ReadFile(filepath.Join(in, benchdata.E2EFile))
	if err != nil {
		return fmt.Errorf("end-to-end results: %w", err)
	}
	var r results
	if err := json.Unmarshal(data, &r); err != nil {
		return fmt.Errorf("%s: %w", benchdata.E2EFile, err)
	}
	c, err := readControl(filepath.Join(in, "iptables-control.txt"))
	if err != nil {
		return fmt.Errorf("control plane benchmarks: %w", err)
	}
	if err := os.MkdirAll(docs, 0o755); err != nil {
		return err
	}
	var md bytes.Buffer
	writeReport(&md, m, mr, &r, c)
	out := md.Bytes()
	if big.Len() > 0 {
		out = append(out, splice(nil, big.Bytes())...)
	}
	if err := os.WriteFile(path, spliceKernels(out, doc, kernels), 0o644); err != nil {
		return err
	}
	if err := plotCost(m, filepath.Join(docs, "bench-cost-vs-cidrs.png")); err != nil {
		return err
	}
	if err := plotRatios(&r, filepath.Join(docs, "bench-vs-limit.png")); err != nil {
		return err
	}
	return plotCPU(&r, filepath.Join(docs, "bench-cpu-per-conn.png"))
}

var microNames = []struct{ key, title string }{
	{"EgressEstablished", "egress, established flow"},
	{"EgressNewFlow", "egress, new flow"},
	{"IngressReverse", "ingress, reverse NAT"},
	{"EgressReturn", "egress, RETURN (no NAT)"},
	{"IngressReturn", "ingress, RETURN (no NAT)"},
}

func sizes(m micro) []int {
	var out []int
	for key, byN := range m {
		if key == floorKey || strings.HasPrefix(key, connKey("")) {
			continue
		}
		for n := range byN {
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	slices.Sort(out)
	return out
}

// limitOf returns the no-agent result with the same CIDR count (the limit does not depend on it,
// but measuring it beside each keeps the ratio honest on a noisy machine).
func (r *results) limit(cidrs int) (conn, tput float64) {
	for _, l := range r.Load {
		if l.Mode == "none" && l.CIDRs == cidrs {
			return median(l.ConnRates), median(l.Throughputs)
		}
	}
	return 0, 0
}

func (r *results) load(mode string, cidrs int) (conn, tput float64, ok bool) {
	for _, l := range r.Load {
		if l.Mode == mode && l.CIDRs == cidrs {
			return median(l.ConnRates), median(l.Throughputs), true
		}
	}
	return 0, 0, false
}

// runs is how many load runs a mode had at a CIDR count.
func (r *results) runs(mode string, cidrs int) int {
	for _, l := range r.Load {
		if l.Mode == mode && l.CIDRs == cidrs {
			return len(l.ConnRates)
		}
	}
	return 0
}

// cpuPer100k is, per run of a mode, the CPU seconds (system + softirq) per 100k connections;
// none for results without CPU figures.
func (r *results) cpuPer100k(mode string, cidrs int) []float64 {
	var out []float64
	for _, l := range r.Load {
		if l.Mode != mode || l.CIDRs != cidrs {
			continue
		}
		for i, cpu := range l.CPUSeconds {
			if i < len(l.Connections) && l.Connections[i] > 0 {
				out = append(out, cpu/float64(l.Connections[i])*1e5)
			}
		}
	}
	return out
}

func ratio(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

// ratioRange is ratio for a median and the runs' min and max, against the same reference.
func ratioRange(mid, lo, hi, ref float64) string {
	if ref == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx (%.2f-%.2f)", mid/ref, lo/ref, hi/ref)
}

// controlOps are BenchmarkControlPlane's operations, in the order the report shows them.
var controlOps = []struct{ key, title string }{
	{"scrape", "`/metrics` scrape"},
	{"drift", "drift check"},
	{"apply-unchanged", "apply, chain as wanted"},
	{"apply-changed", "apply that changes the chain"},
}

// controlGoalMs is issue 16's bound on a scrape and a drift check beside kube-proxy's rules.
const controlGoalMs = 20

func writeControl(w *bytes.Buffer, c *control) {
	if c == nil {
		return
	}
	fmt.Fprintf(w, "## Control plane beside kube-proxy (iptables backend)\n\n")
	fmt.Fprintf(w, "BenchmarkControlPlane: a node namespace whose nat table holds kube-proxy's 20,000 rules (KUBE-SERVICES,\n")
	fmt.Fprintf(w, "KUBE-SVC-\\*, KUBE-SEP-\\*), the default policy, IPv4. ms per operation, median (min-max) of the runs;\n")
	fmt.Fprintf(w, "commands are the iptables tools run per operation. In legacy mode any read copies the whole table from\n")
	fmt.Fprintf(w, "the kernel.\n\n| operation | mode | runs | ms | commands |\n|---|---|---|---|---|\n")
	for _, op := range controlOps {
		for _, mode := range slices.Sorted(maps.Keys(c.ms)) {
			ms := c.ms[mode][op.key]
			if len(ms) == 0 {
				continue
			}
			lo, mid, hi := spread(ms)
			fmt.Fprintf(w, "| %s | iptables-%s | %d | %.1f (%.1f-%.1f) | %.0f |\n", op.title, mode, len(ms), mid, lo, hi, c.commands[mode][op.key])
		}
	}
	fmt.Fprintln(w)
}

// writeConnection prints BenchmarkConnection: what each packet of one short connection costs.
func writeConnection(w *bytes.Buffer, m micro) {
	total := m[connKey("total")]
	if total == nil {
		return
	}
	ns := slices.Sorted(maps.Keys(total))
	fmt.Fprintf(w, "### One short connection, packet by packet\n\n")
	fmt.Fprintf(w, "BenchmarkConnection: the packets of a masqueraded TCP connection whose server closes first, as the\n")
	fmt.Fprintf(w, "short-connection load below makes them, each through its program (ns, BPF_PROG_TEST_RUN, each with the floor).\n\n| packet |")
	for _, n := range ns {
		fmt.Fprintf(w, " %d CIDRs |", n)
	}
	fmt.Fprintf(w, "\n|---|%s\n", strings.Repeat("---|", len(ns)))
	for _, st := range append(connSteps, struct{ key, title string }{"total", "**the connection**"}) {
		fmt.Fprintf(w, "| %s |", st.title)
		for _, n := range ns {
			fmt.Fprintf(w, " %.0f |", m[connKey(st.key)][n])
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)
}

// writePacketCost prints what the BPF programs cost per run on the uplink during the end-to-end
// loads, from the kernel's run-time statistics.
func writePacketCost(w *bytes.Buffer, r *results) {
	if len(r.PacketCost) == 0 {
		return
	}
	fmt.Fprintf(w, "## Datapath cost per packet on real traffic (kernel BPF statistics)\n\n")
	fmt.Fprintf(w, "ns per run of each program on the uplink during one extra run of the end-to-end loads below, from the\n")
	fmt.Fprintf(w, "kernel's own accounting (BPF_ENABLE_STATS, on for that run only: it adds two clock reads to every run).\n")
	fmt.Fprintf(w, "No BPF_PROG_TEST_RUN floor; *connections* mixes each connection's new flow with its other packets,\n")
	fmt.Fprintf(w, "*bulk* is one established flow: egress runs see its data (GSO super-packets), ingress runs its ACKs.\n\n")
	fmt.Fprintf(w, "| mode | CIDRs | load | egress ns/run | egress runs | ingress ns/run | ingress runs |\n|---|---|---|---|---|---|---|\n")
	type key struct {
		mode  string
		cidrs int
		load  string
	}
	type cell struct {
		ns   float64
		runs uint64
	}
	rows := map[key]map[string]cell{}
	var order []key
	for _, c := range r.PacketCost {
		k := key{c.Mode, c.CIDRs, c.Load}
		if rows[k] == nil {
			rows[k] = map[string]cell{}
			order = append(order, k)
		}
		rows[k][c.Dir] = cell{c.NsPerRun, c.Runs}
	}
	for _, k := range order {
		e, i := rows[k]["egress"], rows[k]["ingress"]
		fmt.Fprintf(w, "| %s | %d | %s | %.0f | %d | %.0f | %d |\n", k.mode, k.cidrs, k.load, e.ns, e.runs, i.ns, i.runs)
	}
	fmt.Fprintln(w)
}

func writeReport(w *bytes.Buffer, m micro, mr microRuns, r *results, c *control) {
	fmt.Fprintf(w, "# Benchmarks\n\n")
	fmt.Fprintf(w, "Measured by `make bench` on %s: %d CPUs (%s), kernel %s, %s. Every end-to-end number is the\n",
		r.StartedAt.Format("2006-01-02"), r.Machine.CPUs, r.Machine.CPU, r.Machine.Kernel, r.Machine.Go)
	fmt.Fprintf(w, "median of several runs in throwaway network namespaces (pod -> node -> external host over veth).\n")
	fmt.Fprintf(w, "Reproduce with `make bench` (root); the raw results land in `bin/bench/`.\n\n")

	fmt.Fprintf(w, "## Datapath cost per packet (BPF_PROG_TEST_RUN)\n\n")
	fmt.Fprintf(w, "ns per packet as the kernel measures one run of the program, by the number of non-masquerade CIDRs:\n")
	fmt.Fprintf(w, "the median of the benchmark's runs (each the mean of its packets), then (min-max) where it ran more than once.\n\n")
	ns := sizes(m)
	fmt.Fprintf(w, "| path |")
	for _, n := range ns {
		fmt.Fprintf(w, " %d CIDRs |", n)
	}
	fmt.Fprintf(w, "\n|---|%s\n", strings.Repeat("---|", len(ns)))
	for _, b := range microNames {
		if m[b.key] == nil {
			continue
		}
		fmt.Fprintf(w, "| %s |", b.title)
		for _, n := range ns {
			if vs := mr[b.key][n]; len(vs) > 1 {
				lo, mid, hi := spread(vs)
				fmt.Fprintf(w, " %.0f (%.0f-%.0f) |", mid, lo, hi)
			} else {
				fmt.Fprintf(w, " %.1f |", m[b.key][n])
			}
		}
		fmt.Fprintln(w)
	}
	if floor, ok := m[floorKey][0]; ok {
		fmt.Fprintf(w, "\nA program that returns at once measures %.1f ns the same way (BenchmarkTestRunFloor): what\n", floor)
		fmt.Fprintf(w, "BPF_PROG_TEST_RUN itself adds to each run (a clock read and softirq masking inside the timed span),\n")
		fmt.Fprintf(w, "which every figure above includes and no packet on the wire pays.\n")
	}
	fmt.Fprintf(w, "\n![cost vs CIDR count](bench-cost-vs-cidrs.png)\n\n")
	writeConnection(w, m)
	writePacketCost(w, r)

	fmt.Fprintf(w, "## End to end, as a fraction of the limit\n\n")
	fmt.Fprintf(w, "The limit is the same topology with no agent (pods keep their addresses). Short connections: %s;\n", "workers open a TCP connection, read one byte and close, over and over; the server closes first")
	fmt.Fprintf(w, "\"slow\" counts connections that took over a second, \"SYNs again\" the SYNs the pod had to send again (a SYN\n")
	fmt.Fprintf(w, "answered by a bare ACK is sent again within some 10 ms, which \"slow\" misses). Before each run the external host's\n")
	fmt.Fprintf(w, "TIME_WAIT sockets are closed, so that no run meets the connections of the mode before it. Bulk: one iperf3 TCP stream.\n")
	fmt.Fprintf(w, "Every mode runs on a node with kube-proxy's conntrack rule, like a real node: *bpf* and *iptables* with default flags\n")
	fmt.Fprintf(w, "(`--random-fully` on), *-norandom* with `--random-fully=false`. Each cell is the median of the runs, then\n")
	fmt.Fprintf(w, "(min-max); modes run interleaved, each run starting with another mode. CPU is the system and softirq time\n")
	fmt.Fprintf(w, "of the whole machine during a run (/proc/stat: the pod's and the external host's sockets, the node's\n")
	fmt.Fprintf(w, "forwarding and NAT, the agent) per 100k completed connections; it is only meaningful on an otherwise quiet machine.\n\n")
	fmt.Fprintf(w, "| mode | CIDRs | runs | connections/s | vs limit | slow | SYNs again | errors | CPU s per 100k conn | vs limit | bulk Gbit/s | vs limit |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, l := range r.Load {
		lc, lt := r.limit(l.CIDRs)
		cl, cm, ch := spread(l.ConnRates)
		tl, tm, th := spread(l.Throughputs)
		cpu := r.cpuPer100k(l.Mode, l.CIDRs)
		ul, um, uh := spread(cpu)
		_, limitCPU, _ := spread(r.cpuPer100k("none", l.CIDRs))
		cpuCell, cpuRatio := "-", "-"
		if len(cpu) > 0 {
			cpuCell, cpuRatio = fmt.Sprintf("%.1f (%.1f-%.1f)", um, ul, uh), ratioRange(um, ul, uh, limitCPU)
		}
		synCell := "-" // results from before the bench counted them
		if len(l.SYNRetrans) > 0 {
			synCell = strconv.FormatInt(median(l.SYNRetrans), 10)
		}
		fmt.Fprintf(w, "| %s | %d | %d | %.0f (%.0f-%.0f) | %s | %d | %s | %d | %s | %s | %.2f (%.2f-%.2f) | %s |\n",
			l.Mode, l.CIDRs, len(l.ConnRates), cm, cl, ch, ratioRange(cm, cl, ch, lc),
			median(l.Slow), synCell, median(l.Errors), cpuCell, cpuRatio, tm/1e9, tl/1e9, th/1e9, ratioRange(tm, tl, th, lt))
	}
	fmt.Fprintf(w, "\nThe plots show the median as the bar and the runs' min and max as the error bar, each as a fraction of\n")
	fmt.Fprintf(w, "the limit's median.\n")
	fmt.Fprintf(w, "\n![rate and throughput vs the limit](bench-vs-limit.png)\n\n![CPU per connection](bench-cpu-per-conn.png)\n\n")
	writeControl(w, c)

	fmt.Fprintf(w, "## Config apply latency\n\nFrom writing the file (a ConfigMap-style `..data` swap) to the agent reporting the datapath holds it;\n")
	fmt.Fprintf(w, "read at once (a ConfigMap swap skips the debounce of other directory events), parsed, compiled and applied. *first*: from the defaults to N CIDRs, which on BPF\n")
	fmt.Fprintf(w, "includes growing the rule maps once (new maps, the programs loaded again and swapped in place); *replace*:\n")
	fmt.Fprintf(w, "N CIDRs replaced by N others, on a datapath already sized for them.\n\n")
	fmt.Fprintf(w, "| backend | CIDRs | change | seconds |\n|---|---|---|---|\n")
	for _, a := range r.Apply {
		fmt.Fprintf(w, "| %s | %d | %s | %.3f |\n", a.Mode, a.CIDRs, a.Kind, a.Seconds)
	}
	fmt.Fprintf(w, "\n## Agent resident memory\n\n| backend | state | RSS MiB |\n|---|---|---|\n")
	for _, mem := range r.Memory {
		state := mem.State
		if mem.NATEntries > 0 {
			state = fmt.Sprintf("%d NAT entries", mem.NATEntries)
		}
		fmt.Fprintf(w, "| %s | %s | %.1f |\n", mem.Mode, state, float64(mem.RSSBytes)/(1<<20))
	}
	fmt.Fprintf(w, "\nBPF map memory lives in the kernel and is not part of the agent's RSS.\n")

	fmt.Fprintf(w, "\n## Goals\n\n| goal | measured | met |\n|---|---|---|\n")
	goal := func(name, measured string, met bool) {
		mark := "yes"
		if !met {
			mark = "**no**"
		}
		fmt.Fprintf(w, "| %s | %s | %s |\n", name, measured, mark)
	}
	// Issue 16's goals: medians of at least minRuns interleaved runs of one make bench.
	const minRuns = 5
	enough := func(modes ...string) (string, bool) {
		for _, mode := range modes {
			if n := r.runs(mode, 0); n < minRuns {
				return fmt.Sprintf(" (%s: %d runs, fewer than %d)", mode, n, minRuns), false
			}
		}
		return "", true
	}
	if c, _, ok := r.load("bpf", 0); ok {
		lc, _ := r.limit(0)
		note, runs := enough("bpf", "none")
		goal("short connections, BPF, default flags >= 0.95x the limit", ratio(c, lc)+note, runs && c >= 0.95*lc)
	}
	if c, _, ok := r.load("bpf", 0); ok {
		if ic, _, ok := r.load("iptables-norandom", 0); ok {
			note, runs := enough("bpf", "iptables-norandom")
			goal("short connections, BPF, default flags ahead of iptables `--random-fully=false`",
				fmt.Sprintf("%.0f vs %.0f conn/s%s", c, ic, note), runs && c > ic)
		}
	}
	if cpu := r.cpuPer100k("bpf", 0); len(cpu) > 0 {
		if none := r.cpuPer100k("none", 0); len(none) > 0 {
			b, l := median(cpu), median(none)
			goal("CPU per connection, BPF, default flags <= 1.1x no NAT", fmt.Sprintf("%.1f vs %.1f s per 100k (%s)", b, l, ratio(b, l)), b <= 1.1*l)
		}
	}
	for _, g := range []struct {
		key, title string
		maxNs      float64
	}{{"EgressNewFlow", "new flow", 600}, {"EgressEstablished", "established flow", 90}, {"IngressReverse", "ingress reverse NAT", 90}} {
		e := m[g.key]
		if len(e) == 0 {
			continue
		}
		worst, at := 0.0, 0
		for n, v := range e {
			if v > worst {
				worst, at = v, n
			}
		}
		goal(fmt.Sprintf("BPF_PROG_TEST_RUN, %s <= %.0f ns at every CIDR count", g.title, g.maxNs), fmt.Sprintf("%.0f ns at worst (%d CIDRs)", worst, at), worst <= g.maxNs)
		if e[1] > 0 && e[100000] > 0 {
			goal(fmt.Sprintf("BPF_PROG_TEST_RUN, %s flat from 1 to 100k CIDRs (<= 1.3x)", g.title), ratio(e[100000], e[1]), e[100000] <= 1.3*e[1])
		}
	}
	if c != nil {
		for _, op := range controlOps[:2] {
			for _, mode := range slices.Sorted(maps.Keys(c.ms)) {
				if ms := c.ms[mode][op.key]; len(ms) > 0 {
					mid := median(ms)
					goal(fmt.Sprintf("%s beside 20k kube-proxy rules < %d ms (iptables-%s)", op.title, controlGoalMs, mode),
						fmt.Sprintf("%.1f ms", mid), mid < controlGoalMs)
				}
			}
		}
	}
	if _, t, ok := r.load("bpf", 0); ok {
		_, lt := r.limit(0)
		goal("bulk throughput, BPF >= 0.97x the limit", ratio(t, lt), t >= 0.97*lt)
	}
	for _, a := range r.Apply {
		if a.Mode == "bpf" && a.CIDRs == 10000 {
			goal(fmt.Sprintf("10k-CIDR config live in < 100 ms on BPF (%s)", a.Kind), fmt.Sprintf("%.0f ms", a.Seconds*1000), a.Seconds < 0.1)
		}
		if a.Mode == "nftables" && a.CIDRs == 100000 {
			goal(fmt.Sprintf("100k-CIDR config live in < 1 s on nftables (%s)", a.Kind), fmt.Sprintf("%.2f s", a.Seconds), a.Seconds < 1)
		}
		// A changed config is live within a second on every backend (docs/configuration.md); BPF's
		// goal above is tighter.
		if a.Mode != "bpf" && a.CIDRs == 10000 {
			goal(fmt.Sprintf("10k-CIDR config live in < 1 s on %s (%s)", a.Mode, a.Kind), fmt.Sprintf("%.2f s", a.Seconds), a.Seconds < 1)
		}
	}
	for _, mem := range r.Memory {
		if mem.State == "idle" {
			goal(fmt.Sprintf("resident memory < 40 MB idle (%s)", mem.Mode), fmt.Sprintf("%.1f MiB", float64(mem.RSSBytes)/(1<<20)), mem.RSSBytes < 40<<20)
		}
	}
}

func gnuplot(script string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "gnuplot")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("gnuplot: %w: %s", err, out)
	}
	return nil
}

func plotCost(m micro, out string) error {
	var s strings.Builder
	fmt.Fprintf(&s, "set terminal pngcairo size 900,500 font 'sans,10'\nset output '%s'\n", out)
	s.WriteString("set title 'BPF datapath cost per packet vs number of CIDRs'\nset logscale x\nset xlabel 'non-masquerade CIDRs'\nset ylabel 'ns per packet'\nset key top left\nset grid\nset yrange [0:*]\n")
	var plots []string
	var data strings.Builder
	for _, b := range microNames {
		if m[b.key] == nil {
			continue
		}
		plots = append(plots, fmt.Sprintf("'-' using 1:2 with linespoints title '%s'", b.title))
		ns := sizes(m)
		for _, n := range ns {
			if v, ok := m[b.key][n]; ok {
				fmt.Fprintf(&data, "%d %f\n", n, v)
			}
		}
		data.WriteString("e\n")
	}
	s.WriteString("plot " + strings.Join(plots, ", ") + "\n" + data.String())
	return gnuplot(s.String())
}

// plotRatios draws, per mode and CIDR count, the short-connection rate and the bulk throughput as
// fractions of the limit's median: the runs' median as the bar, their min and max as its error bar.
func plotRatios(r *results, out string) error {
	var s strings.Builder
	fmt.Fprintf(&s, "set terminal pngcairo size 1000,520 font 'sans,10'\nset output '%s'\n", out)
	s.WriteString("set title 'End to end, as a fraction of the no-agent limit (median of runs, bars from min to max)'\nset style data histograms\nset style histogram errorbars gap 1 lw 1\nset style fill solid 0.8 border -1\nset boxwidth 0.9\nset yrange [0:*]\nset ylabel 'fraction of the limit'\nset grid ytics\nset key top right\nset xtics rotate by -20\n")
	s.WriteString("plot '-' using 2:3:4:xtic(1) title 'short connections/s', '-' using 2:3:4 title 'bulk throughput'\n")
	var conn, tput strings.Builder
	for _, l := range r.Load {
		if l.Mode == "none" {
			continue
		}
		lc, lt := r.limit(l.CIDRs)
		label := fmt.Sprintf("%s, %d CIDRs", l.Mode, l.CIDRs)
		if lc > 0 {
			lo, mid, hi := spread(l.ConnRates)
			fmt.Fprintf(&conn, "\"%s\" %f %f %f\n", label, mid/lc, lo/lc, hi/lc)
		}
		if lt > 0 {
			lo, mid, hi := spread(l.Throughputs)
			fmt.Fprintf(&tput, "\"%s\" %f %f %f\n", label, mid/lt, lo/lt, hi/lt)
		}
	}
	s.WriteString(conn.String() + "e\n" + tput.String() + "e\n")
	return gnuplot(s.String())
}

// plotCPU draws the CPU seconds per 100k connections of every mode and CIDR count: the median as
// the bar, the runs' min and max as its error bar.
func plotCPU(r *results, out string) error {
	var data strings.Builder
	for _, l := range r.Load {
		if cpu := r.cpuPer100k(l.Mode, l.CIDRs); len(cpu) > 0 {
			lo, mid, hi := spread(cpu)
			fmt.Fprintf(&data, "\"%s, %d CIDRs\" %f %f %f\n", l.Mode, l.CIDRs, mid, lo, hi)
		}
	}
	if data.Len() == 0 {
		return nil // results from before CPU was measured
	}
	var s strings.Builder
	fmt.Fprintf(&s, "set terminal pngcairo size 1000,520 font 'sans,10'\nset output '%s'\n", out)
	s.WriteString("set title 'CPU per connection: system + softirq seconds per 100k short connections (median, bars from min to max)'\nset style data histograms\nset style histogram errorbars gap 1 lw 1\nset style fill solid 0.8 border -1\nset boxwidth 0.9\nset yrange [0:*]\nset ylabel 'CPU seconds per 100k connections'\nset grid ytics\nunset key\nset xtics rotate by -20\n")
	s.WriteString("plot '-' using 2:3:4:xtic(1)\n" + data.String() + "e\n")
	return gnuplot(s.String())
}
