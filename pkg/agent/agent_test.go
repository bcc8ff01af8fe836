package agent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/configwatch"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// waitFor bounds every wait of these tests; the loop reacts in milliseconds, so reaching it
// means a lost event, not a slow machine.
const waitFor = datapathtest.Wait

// configMap is a config directory the kubelet updates (testutil.Projection) holding the
// one key ip-masq-agent.
type configMap struct {
	t *testing.T
	*testutil.Projection
}

func newConfigMap(t *testing.T) *configMap {
	return &configMap{t: t, Projection: testutil.NewProjection(t.TempDir())}
}

func (c *configMap) path() string { return c.Path("ip-masq-agent") }

func (c *configMap) write(content string) {
	c.t.Helper()
	if err := c.Write(map[string]string{"ip-masq-agent": content}); err != nil {
		c.t.Fatal(err)
	}
}

// fileSource is the source of the configuration at path: a file, or a directory.
func fileSource(t *testing.T, path string, opts configwatch.Options) config.Source {
	t.Helper()
	src, err := configwatch.New(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

type running struct {
	agent *Agent
	log   *testutil.Buffer
	done  chan error
	stop  context.CancelFunc
}

func startAgent(t *testing.T, path string, b datapath.Backend, opts ...func(*Options)) *running {
	t.Helper()
	return startAgentWatching(t, path, configwatch.Options{}, b, opts...)
}

// startAgentWatching runs an agent on the file at path, watched with fopts.
func startAgentWatching(t *testing.T, path string, fopts configwatch.Options, b datapath.Backend, opts ...func(*Options)) *running {
	t.Helper()
	logs := &testutil.Buffer{}
	fopts.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	o := Options{Source: fileSource(t, path, fopts), Backend: b, RetryMin: 20 * time.Millisecond,
		RetryMax: 80 * time.Millisecond, Logger: fopts.Logger}
	for _, f := range opts {
		f(&o)
	}
	a, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{agent: a, log: logs, done: make(chan error, 1), stop: cancel}
	go func() { r.done <- a.Run(ctx, nil) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(waitFor):
			t.Error("agent did not stop")
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", logs.String())
		}
	})
	return r
}

func (r *running) ready(t *testing.T) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	r.agent.Mux().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	return rec.Code, rec.Body.String()
}

// waitReady waits for /readyz to answer 200: the agent marks itself ready just after the
// backend's Apply returned.
func (r *running) waitReady(t *testing.T) {
	t.Helper()
	if err := testutil.Poll(waitFor, time.Millisecond, func() error {
		if code, body := r.ready(t); code != http.StatusOK {
			return testutil.NotYet("ready: %d %q", code, body)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

func nonMasq(p *policy.Policy) []netip.Prefix {
	var out []netip.Prefix
	for _, r := range p.IPv4 {
		if r.Origin == policy.OriginNonMasqueradeCIDRs {
			out = append(out, r.Prefix)
		}
	}
	return out
}

func TestMissingFileAppliesDefaultsAndBecomesReady(t *testing.T) {
	b := &datapathtest.Backend{}
	b.Gate = make(chan struct{})
	dir := t.TempDir()
	r := startAgent(t, filepath.Join(dir, "ip-masq-agent"), b)

	// Before the first apply finishes: not ready.
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "not applied yet") {
		t.Errorf("readyz before apply = %d %q, want 503", code, body)
	}
	close(b.Gate)
	p := b.WaitApply(t)
	want := policy.Compile(config.Default(config.Options{}), policy.Options{})
	if fmt.Sprint(p) != fmt.Sprint(want) {
		t.Errorf("applied %+v, want the defaults %+v", p, want)
	}
	r.waitReady(t)
	rec := httptest.NewRecorder()
	r.agent.Mux().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	if rec.Code != http.StatusOK {
		t.Errorf("healthz = %d", rec.Code)
	}
}

func TestConfigMapSwapTakesEffect(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b)
	if got := nonMasq(b.WaitApply(t)); fmt.Sprint(got) != "[10.0.0.0/8]" {
		t.Fatalf("first apply %v", got)
	}
	start := time.Now()
	cm.write("nonMasqueradeCIDRs: [192.168.0.0/16]\n")
	p := b.WaitApply(t)
	t.Logf("config swap to apply: %v", time.Since(start))
	if got := nonMasq(p); fmt.Sprint(got) != "[192.168.0.0/16]" {
		t.Fatalf("after the swap applied %v", got)
	}
	// A change in the directory that leaves the policy as it is applies nothing.
	if err := os.WriteFile(filepath.Join(cm.Dir, "unrelated"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	b.NoApply(t, 300*time.Millisecond)
	if s := r.agent.Stats(); s.Applies != 2 || s.ConfigErrors != 0 || !s.Ready {
		t.Errorf("stats %+v", s)
	}
}

// A ConfigMap's "..data" swap is applied at once, not after the debounce: the kubelet writes
// the new content whole before the rename, so there is nothing to wait for.
func TestConfigMapSwapSkipsDebounce(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := &datapathtest.Backend{}
	startAgentWatching(t, cm.path(), configwatch.Options{Debounce: time.Minute}, b)
	b.WaitApply(t)
	cm.write("nonMasqueradeCIDRs: [192.168.0.0/16]\n")
	select {
	case p := <-b.Applied():
		if got := nonMasq(p); fmt.Sprint(got) != "[192.168.0.0/16]" {
			t.Fatalf("after the swap applied %v", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the swap waited for the debounce (a minute)")
	}
}

func TestEditorRenameAndLateFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	b := &datapathtest.Backend{}
	startAgent(t, path, b)
	if got := nonMasq(b.WaitApply(t)); len(got) != 3 {
		t.Fatalf("defaults expected first, got %v", got)
	}
	// The file appears later, written to a temporary name and renamed into place.
	tmp := filepath.Join(dir, ".config.yaml.swp")
	if err := os.WriteFile(tmp, []byte("nonMasqueradeCIDRs: [10.0.0.0/8]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	if got := nonMasq(b.WaitApply(t)); fmt.Sprint(got) != "[10.0.0.0/8]" {
		t.Fatalf("after the rename applied %v", got)
	}
	// Removing the file means the defaults again.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if got := nonMasq(b.WaitApply(t)); len(got) != 3 {
		t.Fatalf("after removal applied %v, want the defaults", got)
	}
}

func TestBadConfigKeepsLastGood(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b)
	b.WaitApply(t)

	cm.write("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	r.waitStats(t, "the bad file noticed", func(s Stats) bool { return s.ConfigErrors > 0 })
	b.NoApply(t, 200*time.Millisecond)
	logs := r.log.String()
	for _, want := range []string{"config rejected; the last good configuration stays in force", `10.0.0.1/8`, "host bits are set"} {
		if !strings.Contains(logs, want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
	if code, _ := r.ready(t); code != http.StatusOK {
		t.Errorf("a bad file after a good one made the agent unready: %d", code)
	}
	// The rejection is told, with the problem, while the good configuration stays ready.
	if s := r.agent.Stats(); !strings.Contains(s.Rejected, `nonMasqueradeCIDRs[0]: "10.0.0.1/8": host bits are set`) || s.NotReady != "" {
		t.Errorf("rejected %q, not ready %q", s.Rejected, s.NotReady)
	}
	// The next change is tried again.
	cm.write("nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	if got := nonMasq(b.WaitApply(t)); fmt.Sprint(got) != "[172.16.0.0/12]" {
		t.Fatalf("after the fix applied %v", got)
	}
	if s := r.agent.Stats(); s.Rejected != "" {
		t.Errorf("still rejected after a good file: %q", s.Rejected)
	}
}

// A configuration of many problems is told by its first ones in Stats, all of them in the log.
func TestRejectedSummary(t *testing.T) {
	cm := newConfigMap(t)
	var cidrs []string
	for i := range 12 {
		cidrs = append(cidrs, fmt.Sprintf("10.%d.0.1/16", i))
	}
	cm.write("nonMasqueradeCIDRs: [" + strings.Join(cidrs, ", ") + "]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b)
	r.waitStats(t, "the rejection", func(s Stats) bool { return s.Rejected != "" })
	s := r.agent.Stats()
	if n := strings.Count(s.Rejected, "host bits are set"); n != maxRejectedLines || !strings.HasSuffix(s.Rejected, "(and 7 more problems)") {
		t.Errorf("rejected (%d problems):\n%s", n, s.Rejected)
	}
	if !strings.Contains(s.NotReady, "no valid configuration yet") {
		t.Errorf("not ready %q", s.NotReady)
	}
	if !strings.Contains(r.log.String(), "10.11.0.1/16") {
		t.Error("the log lacks the last problem")
	}
}

func TestBadConfigAtStartup(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("masqOutBound: maybe\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b)
	r.waitStats(t, "the bad file noticed", func(s Stats) bool { return s.ConfigErrors > 0 })
	b.NoApply(t, 200*time.Millisecond)
	code, body := r.ready(t)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, `masqOutBound: "maybe"`) {
		t.Errorf("readyz = %d %q, want 503 naming the bad value", code, body)
	}
	if s := r.agent.Stats(); !strings.Contains(body, s.NotReady) || s.NotReady == "" {
		t.Errorf("stats say not ready because %q, readyz %q", s.NotReady, body)
	}
	cm.write("masqOutBound: false\n")
	p := b.WaitApply(t)
	if act, _ := p.OutboundAction(policy.IPv4); act != policy.Return {
		t.Errorf("applied %+v, want masqOutBound false", p)
	}
	r.waitReady(t)
}

func TestResyncReappliesEvenWithBadFile(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("resyncInterval: 100ms\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b)
	first := b.WaitApply(t)
	// Two resyncs re-apply the same policy.
	for range 2 {
		if p := b.WaitApply(t); fmt.Sprint(p) != fmt.Sprint(first) {
			t.Fatalf("resync applied %+v, want %+v", p, first)
		}
	}
	// With a bad file the resync re-applies the last good policy (healing drift) and keeps
	// counting the bad file.
	cm.write("resyncInterval: 100ms\nnonMasqueradeCIDRs: nope\n")
	errs := r.agent.Stats().ConfigErrors
	for range 2 {
		if p := b.WaitApply(t); fmt.Sprint(p) != fmt.Sprint(first) {
			t.Fatalf("resync with a bad file applied %+v", p)
		}
	}
	// The file's change is counted once; two more errors from wherever errs was read take a
	// resync. (The applies above may have been waiting already when a loaded machine let this
	// goroutine run again, so the count is waited for, not read.)
	r.waitStats(t, "config errors counted on resync", func(s Stats) bool { return s.ConfigErrors >= errs+2 })
}

func TestApplyFailureIsRetried(t *testing.T) {
	b := &datapathtest.Backend{}
	b.FailApplies(3)
	r := startAgent(t, filepath.Join(t.TempDir(), "none"), b)
	b.WaitApply(t)
	r.waitReady(t)
	s := r.agent.Stats()
	if s.ApplyErrors != 3 || s.Applies != 1 || !s.Ready {
		t.Errorf("stats %+v, want 3 errors then one success", s)
	}
	if got := strings.Count(r.log.String(), "apply failed; retrying"); got != 3 {
		t.Errorf("%d retry logs, want 3:\n%s", got, r.log.String())
	}
	if !strings.Contains(r.log.String(), "line 3 failed") {
		t.Errorf("the backend's error is not logged:\n%s", r.log.String())
	}
}

func TestApplyFailureNotReady(t *testing.T) {
	b := &datapathtest.Backend{}
	b.FailApplies(1 << 30)
	r := startAgent(t, filepath.Join(t.TempDir(), "none"), b, func(o *Options) { o.RetryMin, o.RetryMax = time.Hour, time.Hour })
	r.waitStats(t, "an apply attempt", func(s Stats) bool { return s.ApplyErrors > 0 })
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "apply failed") {
		t.Errorf("readyz = %d %q", code, body)
	}
}

func TestShutdownLeavesDatapath(t *testing.T) {
	b := &datapathtest.Backend{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(Options{Source: fileSource(t, filepath.Join(t.TempDir(), "none"), configwatch.Options{}), Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, ln) }()
	b.WaitApply(t)
	// Ready follows the apply by a hair.
	if err := testutil.Poll(waitFor, time.Millisecond, func() error {
		resp, err := http.Get("http://" + ln.Addr().String() + "/readyz")
		if err != nil {
			return err
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return testutil.NotYet("readyz over HTTP = %d %q", resp.StatusCode, body)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after shutdown = %v, want nil", err)
		}
	case <-time.After(waitFor):
		t.Fatal("Run did not return")
	}
	if b.Cleanups() != 0 {
		t.Errorf("shutdown cleaned the datapath up")
	}
	if _, err := http.Get("http://" + ln.Addr().String() + "/healthz"); err == nil {
		t.Errorf("health endpoint still served after shutdown")
	}
}

func TestDatapathEventReapplies(t *testing.T) {
	b := &datapathtest.Backend{}
	events := make(chan string)
	r := startAgent(t, filepath.Join(t.TempDir(), "none"), b, func(o *Options) { o.Changes = events })
	first := b.WaitApply(t)
	events <- "uplink address changed"
	if p := b.WaitApply(t); fmt.Sprint(p) != fmt.Sprint(first) {
		t.Errorf("re-applied %+v, want the same policy", p)
	}
	if !strings.Contains(r.log.String(), "uplink address changed") {
		t.Errorf("the event's reason is not logged:\n%s", r.log.String())
	}
	// A closed channel ends the events, not the agent.
	close(events)
	b.NoApply(t, 100*time.Millisecond)
	if r.agent.Stats().Applies != 2 {
		t.Errorf("stats %+v", r.agent.Stats())
	}
}

// waitStats waits until the agent's stats satisfy cond, and returns them.
func (r *running) waitStats(t *testing.T, what string, cond func(Stats) bool) Stats {
	t.Helper()
	var s Stats
	if err := testutil.Poll(waitFor, time.Millisecond, func() error {
		if s = r.agent.Stats(); !cond(s) {
			return testutil.NotYet("%s: stats %+v", what, s)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return s
}

func hashOf(t *testing.T, doc string) string {
	t.Helper()
	cfg, err := config.Parse([]byte(doc), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return ConfigHash(cfg)
}

// appliedIs checks that the agent's Applied is the configuration of doc, with its hash.
func (r *running) appliedIs(t *testing.T, what, doc string) {
	t.Helper()
	got, ok := r.agent.Applied()
	want, err := config.Parse([]byte(doc), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !ok || string(got.Config.Canonical()) != string(want.Canonical()) || got.SHA256 != ConfigHash(want) {
		t.Errorf("%s: applied %s (ok %v, hash %s), want %s", what, got.Config.Canonical(), ok, got.SHA256, want.Canonical())
	}
}

// Every reload counts once by result; the hash and Applied follow the configuration in force;
// every apply is timed.
func TestReloadStats(t *testing.T) {
	const (
		docA     = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
		docASame = "nonMasqueradeCIDRs: [10.0.0.0/8]\ncidrLimit: 10\n" // same policy, other config
		docB     = "nonMasqueradeCIDRs: [192.168.0.0/16]\n"
	)
	cm := newConfigMap(t)
	cm.write(docA)
	b := &datapathtest.Backend{}
	start := time.Now()
	obs := &applyObserver{}
	r := startAgent(t, cm.path(), b, func(o *Options) { o.Observer = obs })
	b.WaitApply(t)
	s := r.waitStats(t, "the first reload", func(s Stats) bool { return s.Reloads == 1 })
	if s.ConfigSHA256 != hashOf(t, docA) || s.LastReload.Before(start) || s.ConfigErrors+s.ReloadApplyErrors != 0 {
		t.Errorf("after the first reload: %+v", s)
	}
	r.appliedIs(t, "after the first reload", docA)
	if took, errs := obs.applies(); len(took) != 1 || took[0] <= 0 || errs != 0 {
		t.Errorf("applies observed: %v, %d failed; want one", took, errs)
	}
	if got := ConfigHash(config.Default(config.Options{})); got == s.ConfigSHA256 || len(got) != 64 {
		t.Errorf("hash of the defaults %q vs %q", got, s.ConfigSHA256)
	}

	// A file with the same policy: nothing applied, but it is the configuration in force.
	last := s.LastReload
	cm.write(docASame)
	s = r.waitStats(t, "the second reload", func(s Stats) bool { return s.Reloads == 2 })
	if s.ConfigSHA256 != hashOf(t, docASame) || !s.LastReload.After(last) || s.Applies != 1 {
		t.Errorf("after a reload of the same policy: %+v", s)
	}
	r.appliedIs(t, "after a reload of the same policy", docASame)
	b.NoApply(t, 50*time.Millisecond)

	// A bad file: counted, the hash stays.
	cm.write("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	s = r.waitStats(t, "the bad file", func(s Stats) bool { return s.ConfigErrors == 1 })
	if s.ConfigSHA256 != hashOf(t, docASame) || s.Reloads != 2 {
		t.Errorf("after a bad file: %+v", s)
	}
	r.appliedIs(t, "after a bad file", docASame)

	// A good file whose first apply fails: one apply error, then the retry's reload succeeds.
	b.FailApplies(1)
	cm.write(docB)
	b.WaitApply(t)
	s = r.waitStats(t, "the retried reload", func(s Stats) bool { return s.Reloads == 3 })
	if s.ReloadApplyErrors != 1 || s.ApplyErrors != 1 || s.Applies != 2 || s.ConfigSHA256 != hashOf(t, docB) {
		t.Errorf("after a failed then retried apply: %+v", s)
	}
	r.appliedIs(t, "after a failed then retried apply", docB)
	if took, errs := obs.applies(); len(took) != 3 || errs != 1 {
		t.Errorf("applies observed: %v, %d failed; want three, one failed", took, errs)
	}
}

// applyObserver records what the agent tells its Observer.
type applyObserver struct {
	mu   sync.Mutex
	took []time.Duration
	errs int
}

func (o *applyObserver) ObserveApply(took time.Duration, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.took = append(o.took, took)
	if err != nil {
		o.errs++
	}
}

func (o *applyObserver) applies() ([]time.Duration, int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.took), o.errs
}
