// Command report turns the benchmark results of `make bench` into docs/benchmarks.md and PNG
// plots (drawn with gnuplot).
//
//	report -in DIR -docs docs
//
// DIR holds micro.txt (the output of the BPF_PROG_TEST_RUN benchmarks of pkg/bpf) and e2e.json
// (written by BenchmarkEndToEnd in test/bench).
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
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

// The e2e.json schema (see test/bench).
type results struct {
	Machine struct {
		Kernel string `json:"kernel"`
		CPUs   int    `json:"cpus"`
		CPU    string `json:"cpu"`
		Go     string `json:"go"`
	} `json:"machine"`
	Load []struct {
		Mode        string    `json:"mode"`
		CIDRs       int       `json:"cidrs"`
		ConnRates   []float64 `json:"conn_rates"`
		Slow        []int64   `json:"slow"`
		Errors      []int64   `json:"errors"`
		Throughputs []float64 `json:"throughputs"`
	} `json:"load"`
	Apply []struct {
		Mode    string  `json:"mode"`
		CIDRs   int     `json:"cidrs"`
		Kind    string  `json:"kind"`
		Seconds float64 `json:"seconds"`
	} `json:"apply"`
	Memory []struct {
		Mode       string `json:"mode"`
		State      string `json:"state"`
		RSSBytes   int64  `json:"rss_bytes"`
		NATEntries int    `json:"nat_entries"`
	} `json:"memory"`
	StartedAt time.Time `json:"started_at"`
}

// micro maps benchmark name -> CIDR count -> ns per packet.
type micro map[string]map[int]float64

var benchLine = regexp.MustCompile(`^Benchmark(\w+)/cidrs=(\d+)(?:-\d+)?\s+\d+\s+.*?([\d.]+) ns/pkt`)

func readMicro(path string) (micro, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	m := micro{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		g := benchLine.FindStringSubmatch(sc.Text())
		if g == nil {
			continue
		}
		n, _ := strconv.Atoi(g[2])
		v, _ := strconv.ParseFloat(g[3], 64)
		if m[g[1]] == nil {
			m[g[1]] = map[int]float64{}
		}
		m[g[1]][n] = v
	}
	return m, sc.Err()
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
	m, err := readMicro(filepath.Join(in, "micro.txt"))
	if err != nil {
		return fmt.Errorf("micro benchmarks: %w", err)
	}
	data, err := os.ReadFile(filepath.Join(in, "e2e.json"))
	if err != nil {
		return fmt.Errorf("end-to-end results: %w", err)
	}
	var r results
	if err := json.Unmarshal(data, &r); err != nil {
		return fmt.Errorf("e2e.json: %w", err)
	}
	if err := os.MkdirAll(docs, 0o755); err != nil {
		return err
	}
	var md bytes.Buffer
	writeReport(&md, m, &r)
	if err := os.WriteFile(filepath.Join(docs, "benchmarks.md"), md.Bytes(), 0o644); err != nil {
		return err
	}
	if err := plotCost(m, filepath.Join(docs, "bench-cost-vs-cidrs.png")); err != nil {
		return err
	}
	return plotRatios(&r, filepath.Join(docs, "bench-vs-limit.png"))
}

var microNames = []struct{ key, title string }{
	{"EgressEstablished", "egress, established flow"},
	{"EgressNewFlow", "egress, new flow"},
	{"IngressReverse", "ingress, reverse NAT"},
	{"EgressReturn", "egress, RETURN (no NAT)"},
}

func sizes(m micro) []int {
	var out []int
	for _, byN := range m {
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

func ratio(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

func writeReport(w *bytes.Buffer, m micro, r *results) {
	fmt.Fprintf(w, "# Benchmarks\n\n")
	fmt.Fprintf(w, "Measured by `make bench` on %s: %d CPUs (%s), kernel %s, %s. Every end-to-end number is the\n",
		r.StartedAt.Format("2006-01-02"), r.Machine.CPUs, r.Machine.CPU, r.Machine.Kernel, r.Machine.Go)
	fmt.Fprintf(w, "median of several runs in throwaway network namespaces (pod -> node -> external host over veth).\n")
	fmt.Fprintf(w, "Reproduce with `make bench` (root); the raw results land in `bin/bench/`.\n\n")

	fmt.Fprintf(w, "## Datapath cost per packet (BPF_PROG_TEST_RUN)\n\n")
	fmt.Fprintf(w, "ns per packet as the kernel measures one run of the program, by the number of non-masquerade CIDRs.\n\n")
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
			fmt.Fprintf(w, " %.1f |", m[b.key][n])
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "\n![cost vs CIDR count](bench-cost-vs-cidrs.png)\n\n")

	fmt.Fprintf(w, "## End to end, as a fraction of the limit\n\n")
	fmt.Fprintf(w, "The limit is the same topology with no agent (pods keep their addresses). Short connections: %s;\n", "workers open a TCP connection, read one byte and close, over and over; the server closes first")
	fmt.Fprintf(w, "\"slow\" counts connections that took over a second (a retransmitted SYN). Bulk: one iperf3 TCP stream.\n")
	fmt.Fprintf(w, "Every mode runs on a node with kube-proxy's conntrack rule, like a real node, and default flags (`--random-fully` on).\n\n")
	fmt.Fprintf(w, "| mode | CIDRs | connections/s | vs limit | slow | errors | bulk Gbit/s | vs limit |\n|---|---|---|---|---|---|---|---|\n")
	for _, l := range r.Load {
		lc, lt := r.limit(l.CIDRs)
		c, t := median(l.ConnRates), median(l.Throughputs)
		fmt.Fprintf(w, "| %s | %d | %.0f | %s | %d | %d | %.2f | %s |\n", l.Mode, l.CIDRs, c, ratio(c, lc),
			median(l.Slow), median(l.Errors), t/1e9, ratio(t, lt))
	}
	fmt.Fprintf(w, "\n![rate and throughput vs the limit](bench-vs-limit.png)\n\n")

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
	if c, _, ok := r.load("bpf", 0); ok {
		lc, _ := r.limit(0)
		goal("short-connection rate, BPF, default flags >= 0.9x the limit", ratio(c, lc), c >= 0.9*lc)
	}
	if _, t, ok := r.load("bpf", 0); ok {
		_, lt := r.limit(0)
		goal("bulk throughput, BPF >= 0.97x the limit", ratio(t, lt), t >= 0.97*lt)
	}
	if e := m["EgressEstablished"]; e != nil && e[1] > 0 && e[100000] > 0 {
		goal("established-flow cost at 100k CIDRs <= 1.3x the cost at 1 CIDR", ratio(e[100000], e[1]), e[100000] <= 1.3*e[1])
	}
	for _, a := range r.Apply {
		if a.Mode == "bpf" && a.CIDRs == 10000 {
			goal(fmt.Sprintf("10k-CIDR config live in < 100 ms on BPF (%s)", a.Kind), fmt.Sprintf("%.0f ms", a.Seconds*1000), a.Seconds < 0.1)
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

func plotRatios(r *results, out string) error {
	var s strings.Builder
	fmt.Fprintf(&s, "set terminal pngcairo size 900,500 font 'sans,10'\nset output '%s'\n", out)
	s.WriteString("set title 'End to end, as a fraction of the no-agent limit (median of runs)'\nset style data histograms\nset style histogram cluster gap 1\nset style fill solid 0.8 border -1\nset boxwidth 0.9\nset yrange [0:1.2]\nset ylabel 'fraction of the limit'\nset grid ytics\nset key top right\nset xtics rotate by -20\n")
	s.WriteString("plot '-' using 2:xtic(1) title 'short connections/s', '-' using 2 title 'bulk throughput'\n")
	var conn, tput strings.Builder
	for _, l := range r.Load {
		if l.Mode == "none" {
			continue
		}
		lc, lt := r.limit(l.CIDRs)
		c, t := median(l.ConnRates), median(l.Throughputs)
		label := fmt.Sprintf("%s, %d CIDRs", l.Mode, l.CIDRs)
		if lc > 0 {
			fmt.Fprintf(&conn, "\"%s\" %f\n", label, c/lc)
		}
		if lt > 0 {
			fmt.Fprintf(&tput, "\"%s\" %f\n", label, t/lt)
		}
	}
	s.WriteString(conn.String() + "e\n" + tput.String() + "e\n")
	return gnuplot(s.String())
}
