package cluster

import (
	"context"
	"encoding/xml"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
)

// Kubernetes' own sig-network end-to-end tests (a narrowed e2e.test, make k8s-e2e) judge the
// agent as they judge every conformant cluster: on a two-node cluster with CoreDNS, first
// without the agent (the reference), then with the chart on each backend.

// K8sE2EEnv chooses what TestKubernetesE2E runs: "smoke" (the default, make test's: the
// masquerade focus without its slow tests, on the default backend), "full" (the focus without
// the agent, the reference, and on every backend, and the sig-network conformance tests on the
// reference and the default backend) or "off".
const K8sE2EEnv = "IP_MASQ_AGENT_K8S_E2E"

// K8sE2EFocusEnv, when set, is the focus (a regular expression of test names) of every run in
// place of the sets', to rerun a few tests.
const K8sE2EFocusEnv = "IP_MASQ_AGENT_K8S_E2E_FOCUS"

// K8sE2EProcsEnv is how many processes run the tests of a run at once (default 6: the tests
// mostly wait for pods and probes).
const K8sE2EProcsEnv = "IP_MASQ_AGENT_K8S_E2E_PROCS"

// K8sE2EBackendsEnv, when set, narrows the runs to these backends (names, space-separated;
// "none" is the reference), to split a full run or rerun one backend.
const K8sE2EBackendsEnv = "IP_MASQ_AGENT_K8S_E2E_BACKENDS"

// K8sE2EControlEnv, when set, adds the control runs (e2eControlConfig) on each backend of the
// scope. Not by default: the BPF backend fails them (docs/development.md, "the control run").
const K8sE2EControlEnv = "IP_MASQ_AGENT_K8S_E2E_CONTROL"

// K8sE2EReportEnv is the directory the JUnit reports go to (bin/k8s-e2e by default).
const K8sE2EReportEnv = "IP_MASQ_AGENT_K8S_E2E_REPORTS"

// internetAddress is the address the "Internet connection" test dials (TCP port 53): a host
// the cluster's outside namespace owns, so no packet leaves the machine.
var internetAddress = netip.MustParseAddr("8.8.8.8")

// e2eAgentConfig is what a user of this cluster would install: the cluster's own ranges (pods,
// Services, nodes) keep their addresses, everything else is masqueraded. The chart's default
// (10/8, 172.16/12, 192.168/16) covers the same ranges; naming them is what the tests need.
var e2eAgentConfig = fmt.Sprintf(`nonMasqueradeCIDRs:
  - %s
  - %s
  - %s
masqOutBound: true
`, cluster.ClusterPodCIDR, cluster.DefaultServiceCIDR, cluster.NodeNet)

// e2eControlConfig is a user's mistake the tests must catch (the control run): the pods' own
// range left out, so traffic between pods on different nodes is masqueraded.
var e2eControlConfig = fmt.Sprintf(`nonMasqueradeCIDRs:
  - %s
  - %s
masqOutBound: true
`, cluster.DefaultServiceCIDR, cluster.NodeNet)

// controlFocus is what the control run must fail: a pod must see its peers' own addresses.
var controlFocus = []string{`\[sig-network\] NoSNAT`}

// masqueradeFocus is what a masquerading agent can break: pod to pod across nodes without
// SNAT, Services from pods and nodes, the source a Service's server sees, the way out, UDP
// and TCP flows across endpoint changes, and DNS, which rides on all of them.
var masqueradeFocus = []string{
	`\[sig-network\] NoSNAT`,
	`\[sig-network\] Networking Granular Checks: (Pods|Services)`,
	`\[sig-network\] Services should preserve source pod IP for traffic thru service cluster IP`,
	`\[sig-network\] Networking should provide Internet connection for containers \[Feature:Networking-IPv4\]`,
	`\[sig-network\] Conntrack`,
	`\[sig-network\] DNS should (provide DNS for the cluster|provide DNS for services|resolve DNS of partial qualified names|provide /etc/hosts entries for the cluster|provide DNS for pods for (Hostname|Subdomain)|provide DNS for ExternalName services|support configurable pod DNS nameservers|support configurable pod resolv.conf)`,
}

// conformanceFocus is every sig-network conformance test.
var conformanceFocus = []string{`\[sig-network\].*\[Conformance\]`}

// e2eSkips are the tests this cluster cannot run, and why (docs/development.md has the list).
var e2eSkips = []string{
	`SCTP`,                       // a feature and a kernel module the nodes do not load
	`IPv6|[Dd]ual[- ]?[Ss]tack`,  // the cluster is IPv4 only
	`\[Feature:Networking-DNS\]`, // resolves google.com through a real upstream
	`LoadBalancer`,               // no cloud, no load-balancer controller
	`\[Disruptive\]|\[Flaky\]`,   // restarts components that do not run as pods; known flaky
}

// smokeSkips leave out, besides e2eSkips, the slow tests of the focus.
var smokeSkips = []string{`\[Slow\]`, `\[Serial\]`}

// e2eBackend is a backend of the suite, or none: the reference run without the agent.
type e2eBackend struct {
	backend
	none bool
}

// e2eRun is one run of the e2e binary: a set of tests by name and focus, on a backend.
type e2eRun struct {
	set   string
	b     e2eBackend
	focus []string
	// control: the agent installed with e2eControlConfig; every test of the focus must fail.
	control bool
}

func TestKubernetesE2E(t *testing.T) {
	scope := os.Getenv(K8sE2EEnv)
	if scope == "" {
		scope = "smoke"
	}
	if scope == "off" {
		t.Skipf("%s=off", K8sE2EEnv)
	}
	if scope != "smoke" && scope != "full" {
		t.Fatalf("%s=%q: want smoke, full or off", K8sE2EEnv, scope)
	}
	cluster.Require(t)
	bins, err := cluster.E2EBinaries()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Hour)
	defer cancel()

	t.Run("documented", func(t *testing.T) { checkDocumented(ctx, t, bins) })

	start := time.Now()
	img := buildAgentImage(t)
	images, err := cluster.BuildE2EImages(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("agent and e2e images built in %v", time.Since(start).Round(time.Second))

	start = time.Now()
	var c *cluster.Cluster
	t.Cleanup(func() {
		if c == nil {
			return
		}
		if err := c.Gone(); err != nil {
			t.Errorf("after teardown: %v", err)
		}
	})
	c = cluster.Start(t, cluster.ClusterOptions{
		Nodes: 2, DNS: true, ProxyMode: "iptables", IptablesMode: "nft",
		OutsideAddrs: []netip.Prefix{netip.PrefixFrom(internetAddress, 32)},
		Images:       append([]string{img.archive}, images...),
	})
	t.Logf("cluster up (%d nodes, CoreDNS) in %v", len(c.Nodes), time.Since(start).Round(time.Second))
	// "should provide Internet connection for containers" only connects to TCP port 53.
	serveWhoami(t, "/run/netns/"+c.Outside, 53, internetAddress)

	reports := os.Getenv(K8sE2EReportEnv)
	if reports == "" {
		root, err := cluster.RepoRoot()
		if err != nil {
			t.Fatal(err)
		}
		reports = filepath.Join(root, "bin", "k8s-e2e")
	}
	reports = filepath.Join(reports, time.Now().UTC().Format("20060102T150405Z"))
	if err := os.MkdirAll(reports, 0o755); err != nil {
		t.Fatal(err)
	}

	skips := e2eSkips
	if scope == "smoke" {
		skips = append(slices.Clip(skips), smokeSkips...)
	}
	runs := e2eRuns(t, scope)
	w := &world{c: c, img: img}
	table := resultTable{}
	for _, r := range runs {
		name, set := r.b.String(), r.set
		t.Run(set+"/"+name, func(t *testing.T) {
			if !r.b.none {
				v := w.values(r.b.backend, img)
				v["config"] = e2eAgentConfig
				if r.control {
					v["config"] = e2eControlConfig
				}
				helmInstall(t, c, v)
				waitDaemonSet(ctx, t, c, Release)
				if kind := installedKind(ctx, t, c); kind != r.b.kind {
					t.Fatalf("the node has the %q datapath, want %s", kind, r.b.kind)
				}
				defer w.uninstall(ctx, t)
			}
			report := filepath.Join(reports, set+"-"+name+".xml")
			results := runE2E(ctx, t, c, bins, r.focus, skips, report)
			table.add(set, name, results)
			for _, res := range results {
				switch {
				case r.control && res.state == "passed" && strings.HasPrefix(res.name, "[sig-network]"):
					t.Errorf("%s passed with the pods' range masqueraded: the tests cannot tell", res.name)
				case r.control && res.state == "failed" && strings.HasPrefix(res.name, "[sig-network]"):
					// It must fail for the right reason: the peer answered, and saw another
					// source than the pod's (gomega's "Expected <seen> to equal <pod's>"), as
					// conntrack and MASQUERADE do; not a connection that never opened.
					msg := strings.Join(strings.Fields(res.message), " ")
					if !strings.HasPrefix(msg, "Expected <string>: ") || !strings.Contains(msg, " to equal ") {
						t.Errorf("%s failed, but not on a masqueraded source: %s", res.name, msg)
					} else {
						t.Logf("%s failed, as it must: %s", res.name, msg)
					}
				case res.state == "failed":
					t.Errorf("%s: %s", res.name, res.message)
				}
			}
		})
	}
	t.Logf("Kubernetes e2e results (JUnit reports in %s):\n%s", reports, table)
}

// e2eRuns lists the runs of a scope: the reference (no agent) first, then the backends.
func e2eRuns(t *testing.T, scope string) []e2eRun {
	none, standard := e2eBackend{none: true}, e2eBackend{backend: backends[0]}
	on := []e2eBackend{standard}
	if scope == "full" {
		on = []e2eBackend{none}
		for _, b := range backends {
			on = append(on, e2eBackend{backend: b})
		}
	}
	var runs []e2eRun
	if f := os.Getenv(K8sE2EFocusEnv); f != "" {
		for _, b := range on {
			runs = append(runs, e2eRun{set: "focus", b: b, focus: []string{f}})
		}
	} else {
		for _, b := range on {
			runs = append(runs, e2eRun{set: "masquerade", b: b, focus: masqueradeFocus})
		}
		if scope == "full" {
			runs = append(runs,
				e2eRun{set: "conformance", b: none, focus: conformanceFocus},
				e2eRun{set: "conformance", b: standard, focus: conformanceFocus})
		}
	}
	if os.Getenv(K8sE2EControlEnv) != "" {
		for _, b := range on {
			if !b.none {
				runs = append(runs, e2eRun{set: "control", b: b, focus: controlFocus, control: true})
			}
		}
	}
	if only := strings.Fields(os.Getenv(K8sE2EBackendsEnv)); len(only) > 0 {
		for _, name := range only {
			if name != "none" && !slices.ContainsFunc(backends, func(b backend) bool { return b.name == name }) {
				t.Fatalf("%s: no backend %q", K8sE2EBackendsEnv, name)
			}
		}
		runs = slices.DeleteFunc(runs, func(r e2eRun) bool { return !slices.Contains(only, r.b.String()) })
		if len(runs) == 0 {
			t.Fatalf("%s=%q leaves no run of scope %s", K8sE2EBackendsEnv, os.Getenv(K8sE2EBackendsEnv), scope)
		}
	}
	return runs
}

// String names the backend, "none" for the reference.
func (b e2eBackend) String() string {
	if b.none {
		return "none"
	}
	return b.name
}

func e2eProcs(t *testing.T) int {
	v := os.Getenv(K8sE2EProcsEnv)
	if v == "" {
		return 6
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a number of processes", K8sE2EProcsEnv, v)
	}
	return n
}

// e2eResult is one test of a run, as its JUnit report says.
type e2eResult struct {
	name    string
	state   string // passed, failed, skipped (by the test itself)
	message string
	took    time.Duration
}

// runE2E runs the e2e binary in the control plane's network namespace (it needs only the API
// server: every probe is kubectl exec or the API server's proxy) with the focus and skips, in
// e2eProcs parallel processes (ginkgo's command hands the tests out and runs the [Serial] ones
// alone at the end, as upstream's CI does), its JUnit report written to report, and returns
// the tests that ran or skipped themselves.
func runE2E(ctx context.Context, t *testing.T, c *cluster.Cluster, bins cluster.E2EBins, focus, skips []string, report string) []e2eResult {
	t.Helper()
	k8s, err := cluster.Binaries()
	if err != nil {
		t.Fatal(err)
	}
	logPath := strings.TrimSuffix(report, ".xml") + ".log"
	// The framework's own reports and its dumps of failed tests' namespaces, a directory per run.
	dumps := strings.TrimSuffix(report, ".xml")
	if err := os.MkdirAll(dumps, 0o755); err != nil {
		t.Fatal(err)
	}
	args := []string{bins.Ginkgo,
		"--procs=" + strconv.Itoa(e2eProcs(t)),
		"--junit-report=" + report,
		"--no-color",
		"--timeout=4h",
		"--focus=" + strings.Join(focus, "|"),
		"--skip=" + strings.Join(skips, "|"),
		bins.Test, "--",
		"--kubeconfig=" + c.Kubeconfig,
		"--kubectl-path=" + filepath.Join(k8s, "kubectl"),
		"--provider=skeleton",
		// Only the first process counts the nodes; the others would skip every test that
		// needs two (upstream's runners pass it too).
		"--num-nodes=" + strconv.Itoa(len(c.Nodes)),
		"--report-dir=" + dumps,
	}
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := cluster.Namespaces{Net: "/run/netns/" + c.Netns}.Command(ctx, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = dumps
	// ginkgo checks its own version against the tests' with `go list -m` in the binary's
	// directory, which is in this repository's module: point it at the tools module that built
	// them (a mismatch would be a bug of make k8s-e2e, and ginkgo says so in the log).
	cmd.Env = append(os.Environ(), "GOFLAGS=-modfile="+bins.Modfile)
	start := time.Now()
	runErr := cmd.Run()
	t.Logf("e2e run (%v, log %s): %v", time.Since(start).Round(time.Second), logPath, runErr)
	results, err := readJUnit(report)
	if err != nil {
		t.Fatalf("the e2e run left no report (%v): %v; its log ends:\n%s", runErr, err, tail(logPath, 40))
	}
	ran := 0
	for _, r := range results {
		if r.state != "skipped" {
			ran++
		}
	}
	if ran == 0 {
		t.Fatalf("the focus ran no test; the log ends:\n%s", tail(logPath, 40))
	}
	if runErr != nil && !slices.ContainsFunc(results, func(r e2eResult) bool { return r.state == "failed" }) {
		t.Errorf("the e2e binary failed (%v) with no failed test; the log ends:\n%s", runErr, tail(logPath, 40))
	}
	return results
}

// e2eDoc is where the tests each set chooses are listed, between <!-- k8s-e2e SET --> and
// <!-- /k8s-e2e -->, a "- `name`" line each.
const e2eDoc = "docs/development.md"

// checkDocumented fails unless e2eDoc lists exactly the tests each set chooses (a dry run of the
// binary with the set's focus and e2eSkips), so the list stays the one that runs.
func checkDocumented(ctx context.Context, t *testing.T, bins cluster.E2EBins) {
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(root, e2eDoc))
	if err != nil {
		t.Fatal(err)
	}
	for set, focus := range map[string][]string{"masquerade": masqueradeFocus, "conformance": conformanceFocus} {
		chosen, err := e2eList(ctx, t.TempDir(), bins, focus, e2eSkips)
		if err != nil {
			t.Fatal(err)
		}
		listed, err := documentedE2E(string(doc), set)
		if err != nil {
			t.Fatalf("%s: %v", e2eDoc, err)
		}
		for _, name := range chosen {
			if !slices.Contains(listed, name) {
				t.Errorf("%s does not list the %s test %q", e2eDoc, set, name)
			}
		}
		for _, name := range listed {
			if !slices.Contains(chosen, name) {
				t.Errorf("%s lists %q in %s, which the set does not choose", e2eDoc, name, set)
			}
		}
	}
}

// e2eList is the tests that focus and skips choose, by a dry run of the binary in dir.
func e2eList(ctx context.Context, dir string, bins cluster.E2EBins, focus, skips []string) ([]string, error) {
	report := filepath.Join(dir, "dry-run.xml")
	cmd := exec.CommandContext(ctx, bins.Test, "-ginkgo.dry-run", "-ginkgo.no-color",
		"-ginkgo.junit-report="+report,
		"-ginkgo.focus="+strings.Join(focus, "|"),
		"-ginkgo.skip="+strings.Join(skips, "|"))
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("%s --ginkgo.dry-run: %w: %s", bins.Test, err, out)
	}
	results, err := readJUnit(report)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, r := range results {
		if strings.HasPrefix(r.name, "[sig-network]") {
			names = append(names, specName(r.name))
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("the focus %q chooses no test", focus)
	}
	return names, nil
}

// specLabels is the label list ginkgo's report appends to a test's name.
var specLabels = regexp.MustCompile(` \[sig-network(, [^\]]*)?\]$`)

// specName is a test's name as its report gives it, without the labels it appends.
func specName(name string) string { return specLabels.ReplaceAllString(name, "") }

// documentedE2E reads the tests doc lists for set.
func documentedE2E(doc, set string) ([]string, error) {
	begin := "<!-- k8s-e2e " + set + " -->"
	i := strings.Index(doc, begin)
	if i < 0 {
		return nil, fmt.Errorf("no %s", begin)
	}
	rest := doc[i+len(begin):]
	j := strings.Index(rest, "<!-- /k8s-e2e -->")
	if j < 0 {
		return nil, fmt.Errorf("%s has no end", begin)
	}
	var names []string
	for _, line := range strings.Split(rest[:j], "\n") {
		if line = strings.TrimSpace(line); line != "" {
			name, ok := strings.CutPrefix(line, "- `")
			if !ok || !strings.HasSuffix(name, "`") {
				return nil, fmt.Errorf("%s: %q is not a \"- `name`\" line", begin, line)
			}
			names = append(names, strings.TrimSuffix(name, "`"))
		}
	}
	return names, nil
}

// junitSuites is the part of ginkgo's JUnit report the summary reads.
type junitSuites struct {
	Suites []struct {
		Cases []struct {
			Name    string  `xml:"name,attr"`
			Status  string  `xml:"status,attr"`
			Time    float64 `xml:"time,attr"`
			Failure *struct {
				Message string `xml:"message,attr"`
			} `xml:"failure"`
			Error *struct {
				Message string `xml:"message,attr"`
			} `xml:"error"`
			Skipped *struct {
				Message string `xml:"message,attr"`
			} `xml:"skipped"`
		} `xml:"testcase"`
	} `xml:"testsuite"`
}

// readJUnit reads ginkgo's JUnit report: the tests the focus chose (the suite's own setup
// nodes included, as they can fail too), not those its filters skipped.
func readJUnit(path string) ([]e2eResult, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc junitSuites
	if err := xml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var out []e2eResult
	for _, s := range doc.Suites {
		for _, tc := range s.Cases {
			r := e2eResult{name: strings.TrimPrefix(tc.Name, "[It] "), state: tc.Status, took: time.Duration(tc.Time * float64(time.Second))}
			switch {
			case tc.Failure != nil:
				r.state, r.message = "failed", tc.Failure.Message
			case tc.Error != nil:
				r.state, r.message = "failed", tc.Error.Message
			case tc.Skipped != nil:
				r.state, r.message = "skipped", tc.Skipped.Message
			}
			// Ginkgo reports the specs its filters left out as skipped without running them.
			// (their message is a bare "skipped"; a test that skips itself says why after it).
			if r.state == "skipped" && (r.message == "skipped" || r.message == "") {
				continue
			}
			if r.state == "" {
				r.state = "passed"
			}
			out = append(out, r)
		}
	}
	return out, nil
}

// resultTable is test × backend, per set of tests.
type resultTable map[string]map[string]map[string]string

func (rt resultTable) add(set, backend string, results []e2eResult) {
	if rt[set] == nil {
		rt[set] = map[string]map[string]string{}
	}
	for _, r := range results {
		if rt[set][r.name] == nil {
			rt[set][r.name] = map[string]string{}
		}
		rt[set][r.name][backend] = r.state
	}
}

// String is the table in Markdown, a row per test, a column per backend.
func (rt resultTable) String() string {
	var b strings.Builder
	for _, set := range []string{"masquerade", "conformance", "control", "focus"} {
		rows := rt[set]
		if len(rows) == 0 {
			continue
		}
		var cols []string
		for _, states := range rows {
			for be := range states {
				if !slices.Contains(cols, be) {
					cols = append(cols, be)
				}
			}
		}
		sort.Slice(cols, func(i, j int) bool { return order(cols[i]) < order(cols[j]) })
		names := make([]string, 0, len(rows))
		for n := range rows {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(&b, "\n%s focus:\n| test | %s |\n|---|%s\n", set, strings.Join(cols, " | "), strings.Repeat("---|", len(cols)))
		for _, n := range names {
			cells := make([]string, len(cols))
			for i, c := range cols {
				cells[i] = rows[n][c]
				if cells[i] == "" {
					cells[i] = "-"
				}
			}
			fmt.Fprintf(&b, "| %s | %s |\n", n, strings.Join(cells, " | "))
		}
	}
	return b.String()
}

// order puts the reference first, then the backends in the suite's order.
func order(backend string) int {
	if backend == "none" {
		return -1
	}
	for i, b := range backends {
		if b.name == backend {
			return i
		}
	}
	return len(backends)
}

// tail is the last n lines of a file.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
