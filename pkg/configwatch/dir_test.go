package configwatch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// watchDir watches the directory source at dir until the test ends.
func watchDir(t *testing.T, dir string) (*Dir, <-chan struct{}) {
	t.Helper()
	d, err := NewDir(dir, Options{Quiet: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	changes, err := d.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return d, changes
}

func equalConfig(a, b config.Config) bool { return string(a.Canonical()) == string(b.Canonical()) }

// merged shows what a configuration holds of the lists, for comparisons.
func merged(c config.Config) string {
	return fmt.Sprintf("nonMasq %v masq %v", c.NonMasqueradeCIDRs, c.MasqueradeCIDRs)
}

// waitMerged waits for changes, loading the source after each, until it gives want, and returns
// how long that took. Every change before the call must have been drained (settle).
func waitMerged(t *testing.T, d *Dir, changes <-chan struct{}, want string) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := time.After(10 * time.Second)
	var cfg config.Config
	var err error
	for {
		select {
		case <-changes:
		case <-deadline:
			t.Fatalf("the source never gave %q; last %q, %v", want, merged(cfg), err)
		}
		if cfg, err = d.Load(); err == nil && merged(cfg) == want {
			return time.Since(start)
		}
	}
}

// load loads the source now, or once the file being written settled.
func load(t *testing.T, d *Dir, changes <-chan struct{}) (config.Config, error) {
	t.Helper()
	for {
		cfg, err := d.Load()
		if !errors.Is(err, config.ErrUnsettled) {
			return cfg, err
		}
		select {
		case <-changes:
		case <-time.After(10 * time.Second):
			t.Fatalf("still unsettled: %v", err)
		}
	}
}

// settle waits until no change was reported for a while, so that what comes next is the next
// change's.
func settle(changes <-chan struct{}) {
	for {
		select {
		case <-changes:
		case <-time.After(10 * DefaultDebounce):
			return
		}
	}
}

// noChange fails when a change is reported within a while.
func noChange(t *testing.T, changes <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-changes:
		t.Fatalf("%s was taken for a change", what)
	case <-time.After(10 * DefaultDebounce):
	}
}

// TestDirProjection: several ConfigMaps projected into one volume, updated by "..data" swaps:
// each version is merged, a key added or removed is picked up as fast as a change, and a
// conflicting pair is an error naming both files.
func TestDirProjection(t *testing.T) {
	p := testutil.NewProjection(t.TempDir())
	platform := "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: true\n"
	if err := p.Write(map[string]string{"ip-masq-platform": platform, "ip-masq-user": "masqueradeCIDRs: [10.10.0.0/16]\n",
		"README": "not a configuration"}); err != nil {
		t.Fatal(err)
	}
	d, changes := watchDir(t, p.Dir)
	if cfg, err := load(t, d, changes); err != nil || merged(cfg) != "nonMasq [10.0.0.0/8] masq [10.10.0.0/16]" {
		t.Fatalf("first load: %s, %v", merged(cfg), err)
	}

	steps := []struct {
		what  string
		files map[string]string
		want  string
	}{
		{"the user's file changed", map[string]string{"ip-masq-platform": platform,
			"ip-masq-user": "masqueradeCIDRs: [10.20.0.0/16]\nnonMasqueradeCIDRs: [172.16.0.0/12, 10.0.0.0/8]\n"},
			"nonMasq [10.0.0.0/8 172.16.0.0/12] masq [10.20.0.0/16]"},
		{"a key added", map[string]string{"ip-masq-platform": platform, "ip-masq-user": "masqueradeCIDRs: [10.20.0.0/16]\n",
			"ip-masq-zone": "nonMasqueradeCIDRs: [192.168.0.0/16]\n"},
			"nonMasq [10.0.0.0/8 192.168.0.0/16] masq [10.20.0.0/16]"},
		{"a key removed", map[string]string{"ip-masq-platform": platform, "ip-masq-zone": "nonMasqueradeCIDRs: [192.168.0.0/16]\n"},
			"nonMasq [10.0.0.0/8 192.168.0.0/16] masq []"},
	}
	for _, st := range steps {
		settle(changes)
		if err := p.Write(st.files); err != nil {
			t.Fatal(err)
		}
		took := waitMerged(t, d, changes, st.want)
		t.Logf("%s: picked up in %v", st.what, took)
		if took > time.Second {
			t.Errorf("%s: picked up in %v, want within a second", st.what, took)
		}
	}

	settle(changes)
	if err := p.Write(map[string]string{"ip-masq-platform": platform, "ip-masq-user": "masqOutBound: false\n"}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changes:
	case <-time.After(10 * time.Second):
		t.Fatal("the conflicting version was not reported")
	}
	_, err := d.Load()
	for _, want := range []string{p.Dir, "masqOutBound", "ip-masq-user", "ip-masq-platform"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("a conflicting pair: error %v, want it to name %q", err, want)
		}
	}
}

// TestDirPlainFiles: a directory that is no projection, its files written, replaced and removed
// in place; files the pattern leaves out (other names, hidden ones) change nothing.
func TestDirPlainFiles(t *testing.T) {
	dir := t.TempDir()
	d, changes := watchDir(t, dir)
	if cfg, err := load(t, d, changes); err != nil || !equalConfig(cfg, config.Default(config.Options{})) {
		t.Fatalf("an empty directory: %s, %v; want the defaults", merged(cfg), err)
	}

	writeFile(t, filepath.Join(dir, "ip-masq-a"), "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	waitMerged(t, d, changes, "nonMasq [10.0.0.0/8] masq []")
	writeFile(t, filepath.Join(dir, "ip-masq-b"), "masqueradeCIDRs: [10.1.0.0/16]\n")
	waitMerged(t, d, changes, "nonMasq [10.0.0.0/8] masq [10.1.0.0/16]")

	settle(changes)
	writeFile(t, filepath.Join(dir, "other.yaml"), "masqOutBound: false\n")
	writeFile(t, filepath.Join(dir, ".ip-masq-a.swp"), "x")
	noChange(t, changes, "a file the pattern leaves out")

	tmp := filepath.Join(dir, ".ip-masq-a.tmp")
	writeFile(t, tmp, "nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	if err := os.Rename(tmp, filepath.Join(dir, "ip-masq-a")); err != nil {
		t.Fatal(err)
	}
	waitMerged(t, d, changes, "nonMasq [172.16.0.0/12] masq [10.1.0.0/16]")
	if err := os.Remove(filepath.Join(dir, "ip-masq-b")); err != nil {
		t.Fatal(err)
	}
	waitMerged(t, d, changes, "nonMasq [172.16.0.0/12] masq []")
}

// TestDirLinkedFile: a file of the directory that links elsewhere is reloaded for changes of
// the file it leads to, not for the other files of that directory.
func TestDirLinkedFile(t *testing.T) {
	dir, target := t.TempDir(), t.TempDir()
	real := filepath.Join(target, "real.yaml")
	writeFile(t, real, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	if err := os.Symlink(real, filepath.Join(dir, "ip-masq-linked")); err != nil {
		t.Fatal(err)
	}
	d, changes := watchDir(t, dir)
	if cfg, err := load(t, d, changes); err != nil || merged(cfg) != "nonMasq [10.0.0.0/8] masq []" {
		t.Fatalf("first load: %s, %v", merged(cfg), err)
	}
	writeFile(t, filepath.Join(target, "other"), "x")
	noChange(t, changes, "another file of the directory a config file links into")
	writeFile(t, real, "nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	waitMerged(t, d, changes, "nonMasq [172.16.0.0/12] masq []")
}

// TestDirWhole: a ConfigMap swap is read at once only when every key of the new data has its
// link: the kubelet makes the links of new keys after the swap.
func TestDirWhole(t *testing.T) {
	p := testutil.NewProjection(t.TempDir())
	if err := p.Write(map[string]string{"ip-masq-a": "", "other": ""}); err != nil {
		t.Fatal(err)
	}
	sel := dirSelection{dir: p.Dir, pattern: config.DefaultPattern}
	if !sel.whole() {
		t.Error("a complete projection is not whole")
	}
	if err := os.WriteFile(filepath.Join(p.Dir, "..data", "ip-masq-b"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if sel.whole() {
		t.Error("a projection whose new key has no link yet is whole")
	}
	if err := os.WriteFile(filepath.Join(p.Dir, "..data", "unselected"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..data", "ip-masq-b"), p.Path("ip-masq-b")); err != nil {
		t.Fatal(err)
	}
	if !sel.whole() {
		t.Error("a key the pattern leaves out, without a link, keeps the projection from being whole")
	}
}
