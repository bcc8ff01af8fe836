// Package kernels runs the tests that touch BPF on every kernel of the matrix (internal/vm:
// Debian's 5.10, 6.1 and 6.12 in QEMU) and on the host's: pkg/bpf, pkg/bpfbackend, the
// end-to-end suite on the BPF backend, and the demo, whose table of what the external host saw
// must be the host's. The test binaries are built once, on the host, and run in each guest on
// the host's files.
//
//	KERNELS      the kernels to run, by name ("5.10 6.1 6.12 host"; default: all of them)
//	KERNEL_E2E   where the end-to-end suite runs: "all" kernels (default) or the "oldest" of KERNELS
//	KERNEL_SUITES  the suites to run, by name ("pkg/bpf demo"; default: all of them)
//	KERNEL_JOBS  how many guests run at once (default 3: a guest's tests mostly keep one of its
//	             processors busy, or less, and TCG runs each on a thread of the host)
package kernels

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/internal/vm"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// host names the host's own kernel in KERNELS.
const host = "host"

// target is a kernel the suites run on: a guest's, or the host's (img nil).
type target struct {
	name string
	img  *vm.Image
}

// run runs args on tg, in dir with env added, its output to out: in a guest, or as a process
// of the host's. The error is about the run; the command's own failure is the exit code.
func (tg target) run(args []string, dir string, env []string, timeout time.Duration, out io.Writer) (exitCode int, accel string, err error) {
	if tg.img != nil {
		res, err := tg.img.Run(context.Background(), vm.Command{Args: args, Dir: dir, Env: env, Timeout: timeout, Output: out})
		return res.ExitCode, res.Accel, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = out, out
	err = cmd.Run()
	if exit, ok := err.(*exec.ExitError); ok {
		return exit.ExitCode(), "-", nil
	}
	return 0, "-", err
}

// setUp prepares what TestKernels and BenchmarkKernels run on: the repository's root, the
// targets KERNELS names, and the directory of the binaries, built.
func setUp(tb testing.TB) (root string, targets []target, binDir string) {
	tb.Helper()
	testutil.RequirePrivileged(tb, append([]string{"go", "ip"}, vm.Tools...)...)
	root, err := testutil.RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	targets = chooseTargets(tb, root)
	binDir = filepath.Join(root, "bin", "kernels", "tests")
	build(tb, root, binDir)
	return root, targets, binDir
}

// suite is a set of tests run as one binary on every target.
type suite struct {
	name string
	// bin is the binary under bin/kernels/tests, dir the directory it runs in (a package's, for
	// its testdata), relative to the repository.
	bin, dir string
	args     []string
	// env adds to the environment, guestEnv in the guests alone; $BIN is the tests' binary
	// directory.
	env, guestEnv []string
	timeout       time.Duration
	// e2e marks the end-to-end suite, which KERNEL_E2E places.
	e2e bool
	// cost orders the guests' jobs, the costliest first: minutes under TCG, roughly.
	cost int
	// check, where set, judges the output beside the exit code (the demo's table).
	check func(t *testing.T, out string)
}

// suites are what runs on every kernel. The BPF backends of the end-to-end suite are those the
// kernel can attach (tcx from 6.6, tc everywhere: e2e.Backends probes).
func suites() []suite {
	return []suite{
		// -short: fewer random probes where they check what does not differ between kernels.
		{name: "pkg/bpf", bin: "bpf.test", dir: "pkg/bpf", args: []string{"-test.v", "-test.short", "-test.timeout=50m"}, timeout: time.Hour, cost: 10},
		{name: "pkg/bpfbackend", bin: "bpfbackend.test", dir: "pkg/bpfbackend", args: []string{"-test.v", "-test.timeout=25m"}, timeout: 30 * time.Minute, cost: 2},
		{name: "e2e/bpf", bin: "e2e.test", dir: "test/e2e", args: []string{"-test.v", "-test.timeout=50m"},
			env: []string{"IP_MASQ_AGENT_BIN=$BIN/ip-masq-agent", "IP_MASQ_AGENT_CONNRATE_BIN=$BIN/connrate", e2e.BackendsEnv + "=bpf"},
			// Under TCG the agent starts, loads and attaches several times slower.
			guestEnv: []string{e2e.TimeoutScaleEnv + "=4"},
			timeout:  time.Hour, e2e: true, cost: 15},
		{name: "demo", bin: "demo", dir: ".", args: []string{"-bin", "$BIN/ip-masq-agent", "-backend", "bpf"}, timeout: 10 * time.Minute,
			// Its waits (the agent's readiness above all) scale as the end-to-end suite's.
			guestEnv: []string{e2e.TimeoutScaleEnv + "=4"},
			check:    checkDemo, cost: 1},
	}
}

// builds are the binaries the suites run, built once on the host: the test binaries (go test -c)
// and the programs.
var builds = []struct{ out, pkg string }{
	{"bpf.test", "./pkg/bpf"},
	{"bpfbackend.test", "./pkg/bpfbackend"},
	{"e2e.test", "./test/e2e"},
	{"ip-masq-agent", "./cmd/ip-masq-agent"},
	{"connrate", "./test/bench/connrate"},
	{"demo", "./test/demo"},
}

// TestKernels runs every suite on every kernel of KERNELS, and prints what ran where.
func TestKernels(t *testing.T) {
	root, targets, binDir := setUp(t)
	e2eOn := os.Getenv("KERNEL_E2E")
	only := strings.Fields(os.Getenv("KERNEL_SUITES"))
	workers := 3
	if n, err := strconv.Atoi(os.Getenv("KERNEL_JOBS")); err == nil && n > 0 {
		workers = n
	}
	// The jobs, a suite on a kernel each: the host's first, one at a time (a guest's emulation
	// would take the CPUs from their time-bound tests); then the guests', the longest suites
	// first (suite.cost), so that the last to start are short.
	type job struct {
		tg target
		s  suite
	}
	var hostJobs, guestJobs []job
	for _, s := range suites() {
		for i, tg := range targets {
			if s.e2e && e2eOn == "oldest" && i != 0 || len(only) > 0 && !slices.Contains(only, s.name) {
				continue
			}
			if tg.img == nil {
				hostJobs = append(hostJobs, job{tg, s})
			} else {
				guestJobs = append(guestJobs, job{tg, s})
			}
		}
	}
	slices.SortStableFunc(guestJobs, func(a, b job) int { return cmp.Compare(b.s.cost, a.s.cost) })
	var mu sync.Mutex
	var summary []row
	demoTables := map[string]string{}
	run := func(t *testing.T, j job) {
		r := runSuite(t, root, binDir, j.tg, j.s)
		mu.Lock()
		defer mu.Unlock()
		summary = append(summary, r)
		if j.s.name == "demo" {
			demoTables[j.tg.name] = demoTable(r.output)
		}
	}
	t.Run("matrix", func(t *testing.T) {
		for _, j := range hostJobs {
			t.Run(j.tg.name+"/"+j.s.name, func(t *testing.T) { run(t, j) })
		}
		// Workers take the jobs in order; t.Run may be called from several goroutines at once
		// (parallel subtests would be bounded by -test.parallel, and not in this order).
		next := make(chan job, len(guestJobs))
		for _, j := range guestJobs {
			next <- j
		}
		close(next)
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for j := range next {
					t.Run(j.tg.name+"/"+j.s.name, func(t *testing.T) { run(t, j) })
				}
			})
		}
		wg.Wait()
	})
	printSummary(t, summary)
	compareDemos(t, targets, demoTables)
}

// chooseTargets prepares the kernels KERNELS names, oldest first, the host last.
func chooseTargets(t testing.TB, root string) []target {
	names := strings.Fields(strings.ReplaceAll(os.Getenv("KERNELS"), ",", " "))
	if len(names) == 0 {
		for _, k := range vm.Matrix {
			names = append(names, k.Name)
		}
		names = append(names, host)
	}
	var out []target
	for _, k := range vm.Matrix {
		if !slices.Contains(names, k.Name) {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		img, err := vm.Prepare(ctx, filepath.Join(root, "bin", "kernels"), k)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, target{name: k.Name, img: img})
	}
	if slices.Contains(names, host) {
		out = append(out, target{name: host})
	}
	for _, n := range names {
		if _, err := vm.Lookup(n); err != nil && n != host {
			t.Fatalf("KERNELS: %v", err)
		}
	}
	return out
}

// build builds the suites' binaries into dir.
func build(t testing.TB, root, dir string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	for _, b := range builds {
		args := []string{"build", "-o", filepath.Join(dir, b.out), b.pkg}
		if strings.HasSuffix(b.out, ".test") {
			args = []string{"test", "-c", "-o", filepath.Join(dir, b.out), b.pkg}
		}
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// row is one suite's result on one kernel.
type row struct {
	kernel, suite, accel   string
	pass, skip, fail, took string
	skipped                []string
	output                 string
}

var (
	resultLine = regexp.MustCompile(`^\s*--- (PASS|FAIL|SKIP): (\S+)`)
	eventLine  = regexp.MustCompile(`^=== (?:RUN|NAME|CONT|PAUSE)\s+(\S+)`)
	// TestVerifierComplexity's report of a program.
	verifierLine = regexp.MustCompile(`(?m)^\s+\S+\.go:\d+: (\S+: \d+ instructions processed by the verifier.*)$`)
	skipReason   = regexp.MustCompile(`^\s+\S+\.go:\d+: (.*)$`)
)

// runSuite runs s on tg, keeps its output in bin/kernels/logs, and fails t with what failed.
func runSuite(t *testing.T, root, binDir string, tg target, s suite) row {
	expand := func(v string) string { return strings.ReplaceAll(v, "$BIN", binDir) }
	args := []string{expand(filepath.Join("$BIN", s.bin))}
	for _, a := range s.args {
		args = append(args, expand(a))
	}
	var env []string
	for _, e := range s.env {
		env = append(env, expand(e))
	}
	if tg.img != nil {
		env = append(env, s.guestEnv...)
	}
	dir := filepath.Join(root, s.dir)
	logPath := filepath.Join(root, "bin", "kernels", "logs", tg.name, strings.ReplaceAll(s.name, "/", "-")+".log")
	if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()

	r := row{kernel: tg.name, suite: s.name}
	start := time.Now()
	exitCode, accel, err := tg.run(args, dir, env, s.timeout, logFile)
	r.accel = accel
	r.took = time.Since(start).Round(time.Second).String()
	if err != nil {
		t.Fatalf("%s on %s: %v (output: %s)", s.name, tg.name, err, logPath)
	}
	out, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	r.output = string(out)
	res := parseResults(r.output)
	passed, failed := res.passed, res.failed
	for _, name := range res.skipped {
		r.skipped = append(r.skipped, name+": "+res.reason(name))
	}
	r.pass, r.skip, r.fail = fmt.Sprint(len(passed)), fmt.Sprint(len(r.skipped)), fmt.Sprint(len(failed))
	if exitCode != 0 {
		t.Errorf("%s on %s: exit code %d; failed: %s\n%s\n(whole output: %s)", s.name, tg.name, exitCode,
			strings.Join(failed, " "), res.failures(r.output), logPath)
	}
	if s.check != nil && exitCode == 0 {
		s.check(t, r.output)
	}
	return r
}

// results are what a test binary (-test.v) reported: the tests that passed, failed and skipped,
// and the lines each logged (under its === RUN, NAME or CONT line, and under its result).
type results struct {
	passed, failed, skipped []string
	logs                    map[string][]string
}

func parseResults(out string) results {
	r := results{logs: map[string][]string{}}
	current, inResult := "", -1
	for _, line := range strings.Split(out, "\n") {
		indent := len(line) - len(strings.TrimLeft(line, " "))
		if m := eventLine.FindStringSubmatch(line); m != nil {
			current, inResult = m[1], -1
			continue
		}
		if m := resultLine.FindStringSubmatch(line); m != nil {
			current, inResult = m[2], indent
			switch m[1] {
			case "PASS":
				r.passed = append(r.passed, current)
			case "FAIL":
				r.failed = append(r.failed, current)
			case "SKIP":
				r.skipped = append(r.skipped, current)
			}
			r.logs[current] = append(r.logs[current], line)
			continue
		}
		if current != "" && (inResult < 0 || indent > inResult) {
			r.logs[current] = append(r.logs[current], line)
		}
	}
	return r
}

// reason is why a test skipped: the last line it logged before its result.
func (r results) reason(name string) string {
	logs := r.logs[name]
	for i := len(logs) - 1; i >= 0; i-- {
		if m := skipReason.FindStringSubmatch(logs[i]); m != nil {
			return m[1]
		}
	}
	return "(no reason logged)"
}

// failures is what the binary printed about its failures: each failed test's lines and result;
// the last lines of out where it reported no failure, or panicked.
func (r results) failures(out string) string {
	var b strings.Builder
	for _, name := range r.failed {
		for _, line := range r.logs[name] {
			b.WriteString(line + "\n")
		}
	}
	if b.Len() == 0 || strings.Contains(out, "panic:") {
		b.WriteString(testutil.LastLines(out, 60))
	}
	return b.String()
}

// printSummary logs what ran where: tests passed, skipped (with why) and failed, per suite and
// kernel, and how long each took.
func printSummary(t *testing.T, rows []row) {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "KERNEL\tSUITE\tACCEL\tPASSED\tSKIPPED\tFAILED\tTOOK")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.kernel, r.suite, r.accel, r.pass, r.skip, r.fail, r.took)
	}
	tw.Flush()
	// The verifier's work per program on each kernel (pkg/bpf's TestVerifierComplexity).
	for _, r := range rows {
		for _, m := range verifierLine.FindAllStringSubmatch(r.output, -1) {
			fmt.Fprintf(&b, "verifier on %s: %s\n", r.kernel, m[1])
		}
	}
	for _, r := range rows {
		// By reason: a reason that stops a test stops its subtests with it.
		byReason := map[string][]string{}
		for _, s := range r.skipped {
			name, reason, _ := strings.Cut(s, ": ")
			byReason[reason] = append(byReason[reason], name)
		}
		for _, reason := range slices.Sorted(maps.Keys(byReason)) {
			names := byReason[reason]
			more := ""
			if len(names) > 4 {
				names, more = names[:4], fmt.Sprintf(" and %d more", len(byReason[reason])-4)
			}
			fmt.Fprintf(&b, "skipped on %s (%s): %s%s: %s\n", r.kernel, r.suite, strings.Join(names, ", "), more, reason)
		}
	}
	t.Logf("the kernel matrix:\n%s", b.String())
}

// demoTableHead starts the demo's table of what the external host saw.
const demoTableHead = "== what the external host saw"

// demoTable is the demo's table of what the external host saw, from its heading to the blank
// line after it, as the kernels are compared by it: the ports (chosen at random, by the pods and
// by the NAT) left out, and the columns joined with " | " (tabwriter's padding follows them).
func demoTable(out string) string {
	_, after, ok := strings.Cut(out, demoTableHead)
	if !ok {
		return ""
	}
	table, _, _ := strings.Cut(after, "\n\n")
	var lines []string
	for _, line := range strings.Split(demoTableHead+table, "\n") {
		line = port.ReplaceAllString(line, "$1")
		lines = append(lines, strings.Join(columnGap.Split(strings.TrimSpace(line), -1), " | "))
	}
	return strings.Join(lines, "\n")
}

var (
	port      = regexp.MustCompile(`(\d+\.\d+\.\d+\.\d+|\])\:\d+`)
	columnGap = regexp.MustCompile(`\s{2,}`)
)

// checkDemo: the demo printed its table.
func checkDemo(t *testing.T, out string) {
	if demoTable(out) == "" {
		t.Errorf("the demo printed no table of what the external host saw:\n%s", testutil.LastLines(out, 40))
	}
}

// compareDemos: every kernel's demo table is the host's (the first kernel's where the host's
// demo did not run).
func compareDemos(t *testing.T, targets []target, tables map[string]string) {
	ref := host
	if tables[ref] == "" {
		for _, tg := range targets {
			if tables[tg.name] != "" {
				ref = tg.name
				break
			}
		}
	}
	if tables[ref] == "" {
		return
	}
	for _, tg := range targets {
		if table := tables[tg.name]; table != "" && tg.name != ref && table != tables[ref] {
			t.Errorf("the demo on %s saw otherwise than on %s:\n%s\n\n%s", tg.name, ref, table, tables[ref])
		}
	}
	t.Logf("the demo's table on %s, the same on every kernel that ran it:\n%s", ref, tables[ref])
}
