package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// waitFor bounds every wait of these tests; the loop reacts in milliseconds, so reaching it
// means a lost event, not a slow machine.
const waitFor = 10 * time.Second

// fakeBackend records what the agent applies.
type fakeBackend struct {
	mu       sync.Mutex
	failNext int           // fail this many applies
	gate     chan struct{} // when set, Apply waits for it
	cleanups int
	applied  chan *policy.Policy
}

func newFakeBackend() *fakeBackend { return &fakeBackend{applied: make(chan *policy.Policy, 100)} }

func (f *fakeBackend) Name() string { return "fake" }

func (f *fakeBackend) Apply(ctx context.Context, p *policy.Policy) error {
	f.mu.Lock()
	gate := f.gate
	fail := f.failNext > 0
	if fail {
		f.failNext--
	}
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if fail {
		return errors.New("fake: iptables-restore: line 3 failed")
	}
	f.applied <- p
	return nil
}

func (f *fakeBackend) Counters(context.Context) ([]datapath.RuleCounter, error) { return nil, nil }

func (f *fakeBackend) Cleanup(context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleanups++
	return nil
}

// waitApply returns the next applied policy.
func (f *fakeBackend) waitApply(t *testing.T) *policy.Policy {
	t.Helper()
	select {
	case p := <-f.applied:
		return p
	case <-time.After(waitFor):
		t.Fatal("no apply within", waitFor)
		return nil
	}
}

// noApply checks that nothing is applied for a while.
func (f *fakeBackend) noApply(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case p := <-f.applied:
		t.Fatalf("unexpected apply of %+v", p)
	case <-time.After(d):
	}
}

// syncBuffer is a log sink the test reads while the agent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// configMap writes a config directory the way the kubelet updates a ConfigMap volume: the data
// in a fresh timestamped directory, "..data" swapped to it by a rename, the file a symlink
// through "..data", and the previous data directory removed.
type configMap struct {
	t    *testing.T
	dir  string
	n    int
	prev string // the data directory before the last swap
}

func newConfigMap(t *testing.T) *configMap {
	return &configMap{t: t, dir: t.TempDir()}
}

func (c *configMap) path() string { return filepath.Join(c.dir, "ip-masq-agent") }

func (c *configMap) write(content string) {
	c.t.Helper()
	c.n++
	ts := fmt.Sprintf("..2026_01_01_00_00_%02d.%d", c.n, c.n)
	if err := os.Mkdir(filepath.Join(c.dir, ts), 0o755); err != nil {
		c.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(c.dir, ts, "ip-masq-agent"), []byte(content), 0o644); err != nil {
		c.t.Fatal(err)
	}
	tmp := filepath.Join(c.dir, "..data_tmp")
	if err := os.Symlink(ts, tmp); err != nil {
		c.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(c.dir, "..data")); err != nil {
		c.t.Fatal(err)
	}
	if _, err := os.Lstat(c.path()); errors.Is(err, os.ErrNotExist) {
		if err := os.Symlink(filepath.Join("..data", "ip-masq-agent"), c.path()); err != nil {
			c.t.Fatal(err)
		}
	}
	if c.prev != "" {
		if err := os.RemoveAll(filepath.Join(c.dir, c.prev)); err != nil {
			c.t.Fatal(err)
		}
	}
	c.prev = ts
}

type running struct {
	agent *Agent
	log   *syncBuffer
	done  chan error
	stop  context.CancelFunc
}

func startAgent(t *testing.T, path string, b datapath.Backend, opts ...func(*Options)) *running {
	t.Helper()
	logs := &syncBuffer{}
	o := Options{ConfigPath: path, Backend: b, RetryMin: 20 * time.Millisecond, RetryMax: 80 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
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
	deadline := time.Now().Add(waitFor)
	for {
		code, body := r.ready(t)
		if code == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready: %d %q", code, body)
		}
		time.Sleep(time.Millisecond)
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
	b := newFakeBackend()
	b.gate = make(chan struct{})
	dir := t.TempDir()
	r := startAgent(t, filepath.Join(dir, "ip-masq-agent"), b)

	// Before the first apply finishes: not ready.
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "not applied yet") {
		t.Errorf("readyz before apply = %d %q, want 503", code, body)
	}
	close(b.gate)
	p := b.waitApply(t)
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
	b := newFakeBackend()
	r := startAgent(t, cm.path(), b)
	if got := nonMasq(b.waitApply(t)); fmt.Sprint(got) != "[10.0.0.0/8]" {
		t.Fatalf("first apply %v", got)
	}
	start := time.Now()
	cm.write("nonMasqueradeCIDRs: [192.168.0.0/16]\n")
	p := b.waitApply(t)
	t.Logf("config swap to apply: %v", time.Since(start))
	if got := nonMasq(p); fmt.Sprint(got) != "[192.168.0.0/16]" {
		t.Fatalf("after the swap applied %v", got)
	}
	// A change in the directory that leaves the policy as it is applies nothing.
	if err := os.WriteFile(filepath.Join(cm.dir, "unrelated"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	b.noApply(t, 300*time.Millisecond)
	if s := r.agent.Stats(); s.Applies != 2 || s.ConfigErrors != 0 || !s.Ready {
		t.Errorf("stats %+v", s)
	}
}

// A ConfigMap's "..data" swap is applied at once, not after the debounce: the kubelet writes
// the new content whole before the rename, so there is nothing to wait for.
func TestConfigMapSwapSkipsDebounce(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := newFakeBackend()
	startAgent(t, cm.path(), b, func(o *Options) { o.Debounce = time.Minute })
	b.waitApply(t)
	cm.write("nonMasqueradeCIDRs: [192.168.0.0/16]\n")
	select {
	case p := <-b.applied:
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
	b := newFakeBackend()
	startAgent(t, path, b)
	if got := nonMasq(b.waitApply(t)); len(got) != 3 {
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
	if got := nonMasq(b.waitApply(t)); fmt.Sprint(got) != "[10.0.0.0/8]" {
		t.Fatalf("after the rename applied %v", got)
	}
	// Removing the file means the defaults again.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if got := nonMasq(b.waitApply(t)); len(got) != 3 {
		t.Fatalf("after removal applied %v, want the defaults", got)
	}
}

func TestBadConfigKeepsLastGood(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := newFakeBackend()
	r := startAgent(t, cm.path(), b)
	b.waitApply(t)

	cm.write("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	deadline := time.Now().Add(waitFor)
	for r.agent.Stats().ConfigErrors == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the bad file was not noticed")
		}
		time.Sleep(time.Millisecond)
	}
	b.noApply(t, 200*time.Millisecond)
	logs := r.log.String()
	for _, want := range []string{"config rejected; the last good configuration stays in force", `10.0.0.1/8`, "host bits are set"} {
		if !strings.Contains(logs, want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
	if code, _ := r.ready(t); code != http.StatusOK {
		t.Errorf("a bad file after a good one made the agent unready: %d", code)
	}
	// The next change is tried again.
	cm.write("nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	if got := nonMasq(b.waitApply(t)); fmt.Sprint(got) != "[172.16.0.0/12]" {
		t.Fatalf("after the fix applied %v", got)
	}
}

func TestBadConfigAtStartup(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("masqOutBound: maybe\n")
	b := newFakeBackend()
	r := startAgent(t, cm.path(), b)
	deadline := time.Now().Add(waitFor)
	for r.agent.Stats().ConfigErrors == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the bad file was not noticed")
		}
		time.Sleep(time.Millisecond)
	}
	b.noApply(t, 200*time.Millisecond)
	code, body := r.ready(t)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, `masqOutBound: "maybe"`) {
		t.Errorf("readyz = %d %q, want 503 naming the bad value", code, body)
	}
	cm.write("masqOutBound: false\n")
	p := b.waitApply(t)
	if act, _ := p.OutboundAction(policy.IPv4); act != policy.Return {
		t.Errorf("applied %+v, want masqOutBound false", p)
	}
	r.waitReady(t)
}

func TestResyncReappliesEvenWithBadFile(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("resyncInterval: 100ms\n")
	b := newFakeBackend()
	r := startAgent(t, cm.path(), b)
	first := b.waitApply(t)
	// Two resyncs re-apply the same policy.
	for range 2 {
		if p := b.waitApply(t); fmt.Sprint(p) != fmt.Sprint(first) {
			t.Fatalf("resync applied %+v, want %+v", p, first)
		}
	}
	// With a bad file the resync re-applies the last good policy (healing drift) and keeps
	// counting the bad file.
	cm.write("resyncInterval: 100ms\nnonMasqueradeCIDRs: nope\n")
	errs := r.agent.Stats().ConfigErrors
	for range 2 {
		if p := b.waitApply(t); fmt.Sprint(p) != fmt.Sprint(first) {
			t.Fatalf("resync with a bad file applied %+v", p)
		}
	}
	if r.agent.Stats().ConfigErrors <= errs {
		t.Errorf("config errors not counted on resync: %+v", r.agent.Stats())
	}
}

func TestApplyFailureIsRetried(t *testing.T) {
	b := newFakeBackend()
	b.failNext = 3
	r := startAgent(t, filepath.Join(t.TempDir(), "none"), b)
	b.waitApply(t)
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
	b := newFakeBackend()
	b.failNext = 1 << 30
	r := startAgent(t, filepath.Join(t.TempDir(), "none"), b, func(o *Options) { o.RetryMin, o.RetryMax = time.Hour, time.Hour })
	deadline := time.Now().Add(waitFor)
	for r.agent.Stats().ApplyErrors == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no apply attempt")
		}
		time.Sleep(time.Millisecond)
	}
	if code, body := r.ready(t); code != http.StatusServiceUnavailable || !strings.Contains(body, "apply failed") {
		t.Errorf("readyz = %d %q", code, body)
	}
}

func TestShutdownLeavesDatapath(t *testing.T) {
	b := newFakeBackend()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(Options{ConfigPath: filepath.Join(t.TempDir(), "none"), Backend: b})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx, ln) }()
	b.waitApply(t)
	// Ready follows the apply by a hair.
	deadline := time.Now().Add(waitFor)
	for {
		resp, err := http.Get("http://" + ln.Addr().String() + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("readyz over HTTP = %d %q", resp.StatusCode, body)
		}
		time.Sleep(time.Millisecond)
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
	if b.cleanups != 0 {
		t.Errorf("shutdown cleaned the datapath up")
	}
	if _, err := http.Get("http://" + ln.Addr().String() + "/healthz"); err == nil {
		t.Errorf("health endpoint still served after shutdown")
	}
}

func TestDatapathEventReapplies(t *testing.T) {
	b := newFakeBackend()
	events := make(chan string)
	r := startAgent(t, filepath.Join(t.TempDir(), "none"), b, func(o *Options) { o.Changes = events })
	first := b.waitApply(t)
	events <- "uplink address changed"
	if p := b.waitApply(t); fmt.Sprint(p) != fmt.Sprint(first) {
		t.Errorf("re-applied %+v, want the same policy", p)
	}
	if !strings.Contains(r.log.String(), "uplink address changed") {
		t.Errorf("the event's reason is not logged:\n%s", r.log.String())
	}
	// A closed channel ends the events, not the agent.
	close(events)
	b.noApply(t, 100*time.Millisecond)
	if r.agent.Stats().Applies != 2 {
		t.Errorf("stats %+v", r.agent.Stats())
	}
}

// waitStats waits until the agent's stats satisfy cond, and returns them.
func (r *running) waitStats(t *testing.T, what string, cond func(Stats) bool) Stats {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		s := r.agent.Stats()
		if cond(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: stats %+v", what, s)
		}
		time.Sleep(time.Millisecond)
	}
}

func hashOf(t *testing.T, doc string) string {
	t.Helper()
	cfg, err := config.Parse([]byte(doc), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return ConfigHash(cfg)
}

// Every reload counts once by result; the hash follows the configuration in force; every apply
// is timed.
func TestReloadStats(t *testing.T) {
	const (
		docA     = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
		docASame = "nonMasqueradeCIDRs: [10.0.0.0/8]\ncidrLimit: 10\n" // same policy, other config
		docB     = "nonMasqueradeCIDRs: [192.168.0.0/16]\n"
	)
	cm := newConfigMap(t)
	cm.write(docA)
	b := newFakeBackend()
	start := time.Now()
	r := startAgent(t, cm.path(), b)
	b.waitApply(t)
	s := r.waitStats(t, "the first reload", func(s Stats) bool { return s.Reloads == 1 })
	if s.ConfigSHA256 != hashOf(t, docA) || s.LastReload.Before(start) || s.ConfigErrors+s.ReloadApplyErrors != 0 {
		t.Errorf("after the first reload: %+v", s)
	}
	if h := s.SyncDurations; h.Count != 1 || h.Buckets[numSyncBuckets-1] != 1 || h.Sum <= 0 {
		t.Errorf("sync durations %+v, want one apply", h)
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
	b.noApply(t, 50*time.Millisecond)

	// A bad file: counted, the hash stays.
	cm.write("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	s = r.waitStats(t, "the bad file", func(s Stats) bool { return s.ConfigErrors == 1 })
	if s.ConfigSHA256 != hashOf(t, docASame) || s.Reloads != 2 {
		t.Errorf("after a bad file: %+v", s)
	}

	// A good file whose first apply fails: one apply error, then the retry's reload succeeds.
	b.mu.Lock()
	b.failNext = 1
	b.mu.Unlock()
	cm.write(docB)
	b.waitApply(t)
	s = r.waitStats(t, "the retried reload", func(s Stats) bool { return s.Reloads == 3 })
	if s.ReloadApplyErrors != 1 || s.ApplyErrors != 1 || s.Applies != 2 || s.ConfigSHA256 != hashOf(t, docB) {
		t.Errorf("after a failed then retried apply: %+v", s)
	}
	if h := s.SyncDurations; h.Count != 3 || h.Buckets[numSyncBuckets-1] != 3 {
		t.Errorf("sync durations %+v, want three applies", h)
	}
}

func TestDurationHistogram(t *testing.T) {
	var h DurationHistogram
	for _, d := range []time.Duration{time.Millisecond, 3 * time.Millisecond, time.Second, time.Minute} {
		h.observe(d)
	}
	bounds := SyncBuckets()
	if len(bounds) != numSyncBuckets {
		t.Fatalf("%d bounds, %d buckets", len(bounds), numSyncBuckets)
	}
	for i, bound := range bounds {
		var want uint64
		for _, d := range []float64{0.001, 0.003, 1} {
			if d <= bound {
				want++
			}
		}
		if h.Buckets[i] != want {
			t.Errorf("bucket le=%g holds %d, want %d", bound, h.Buckets[i], want)
		}
	}
	if h.Count != 4 || h.Sum != time.Minute+time.Second+4*time.Millisecond {
		t.Errorf("count %d sum %v", h.Count, h.Sum)
	}
}
