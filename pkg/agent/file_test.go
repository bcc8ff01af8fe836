package agent

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/configwatch"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
)

// Config file hardening: what reaches the policy is a whole, regular file of bounded size, found
// through any symlinks, and a file that cannot be read that way changes nothing.

// replace puts a file, symlink or other node at path atomically, as editors and `ln -sfn` do:
// made under a temporary name, then renamed over path.
func replace(t *testing.T, path string, make func(tmp string) error) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err := make(tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func wantNonMasq(t *testing.T, b *datapathtest.Backend, want string) {
	t.Helper()
	if got := fmt.Sprint(nonMasq(b.WaitApply(t))); got != want {
		t.Fatalf("applied nonMasqueradeCIDRs %s, want %s", got, want)
	}
}

// waitLog waits for the agent to log want.
func (r *running) waitLog(t *testing.T, want string) {
	t.Helper()
	if err := testutil.Poll(waitFor, time.Millisecond, func() error {
		if !strings.Contains(r.log.String(), want) {
			return testutil.NotYet("the agent to log %q", want)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestConfigTooLarge: a file over config.MaxFileSize is refused with an error naming the file,
// its size and the limit, without being read; the last good configuration stays in force and
// the agent stays ready; the next good file is applied.
func TestConfigTooLarge(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	writeFile(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, path, b)
	wantNonMasq(t, b, "[10.0.0.0/8]")

	size := int64(config.MaxFileSize + 1)
	replace(t, path, func(tmp string) error { // sparse: cheap to make
		f, err := os.Create(tmp)
		if err != nil {
			return err
		}
		defer f.Close()
		return f.Truncate(size)
	})
	r.waitStats(t, "the oversized file", func(s Stats) bool { return s.ConfigErrors == 1 })
	b.NoApply(t, 200*time.Millisecond)
	want := fmt.Sprintf("config %s is larger than the limit of %d bytes (16 MiB): %d bytes", path, config.MaxFileSize, size)
	if !strings.Contains(r.log.String(), want) {
		t.Errorf("log lacks %q:\n%s", want, r.log.String())
	}
	if code, _ := r.ready(t); code != http.StatusOK {
		t.Errorf("an oversized file made the agent unready: %d", code)
	}
	writeFile(t, path, "nonMasqueradeCIDRs: [192.168.0.0/16]\n")
	wantNonMasq(t, b, "[192.168.0.0/16]")
}

// TestConfigNotARegularFile: a config path that leads to a named pipe, a device or a directory
// is refused at once (a pipe must not block the loop, a device must not be read) and the loop
// goes on: the good file that replaces it is applied.
func TestConfigNotARegularFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ip-masq-agent")
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	writeFile(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, path, b)
	wantNonMasq(t, b, "[10.0.0.0/8]")
	for i, c := range []struct{ target, kind string }{
		{fifo, "named pipe"}, {"/dev/zero", "character device"}, {t.TempDir(), "directory"},
	} {
		replace(t, path, func(tmp string) error { return os.Symlink(c.target, tmp) })
		r.waitLog(t, fmt.Sprintf("config %s is not a regular file but a %s", path, c.kind))
		b.NoApply(t, 100*time.Millisecond)
		good := fmt.Sprintf("nonMasqueradeCIDRs: [10.%d.0.0/16]\n", i+1)
		replace(t, path, func(tmp string) error { return os.WriteFile(tmp, []byte(good), 0o644) })
		wantNonMasq(t, b, fmt.Sprintf("[10.%d.0.0/16]", i+1))
	}
	if s := r.agent.Stats(); s.ConfigErrors != 3 {
		t.Errorf("stats %+v, want 3 config errors", s)
	}
}

// TestConfigFileIsSymlink: a config file that is a symlink into another directory is followed
// there: a change of the target's content is applied long before the resync would find it, a
// re-pointed link is followed to its new target (and the old one no longer matters), and a link
// to nothing means the defaults, as a missing file does.
func TestConfigFileIsSymlink(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	dirA, dirB := t.TempDir(), t.TempDir()
	a, b2 := filepath.Join(dirA, "a.yaml"), filepath.Join(dirB, "b.yaml")
	const resync = "resyncInterval: 1h\n" // only the watch can see the changes below
	writeFile(t, a, resync+"nonMasqueradeCIDRs: [10.0.0.0/8]\n")
	if err := os.Symlink(a, path); err != nil {
		t.Fatal(err)
	}
	b := &datapathtest.Backend{}
	startAgent(t, path, b)
	wantNonMasq(t, b, "[10.0.0.0/8]")

	writeFile(t, a, resync+"nonMasqueradeCIDRs: [192.168.0.0/16]\n")
	wantNonMasq(t, b, "[192.168.0.0/16]")

	writeFile(t, b2, resync+"nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	replace(t, path, func(tmp string) error { return os.Symlink(b2, tmp) })
	wantNonMasq(t, b, "[172.16.0.0/12]")

	writeFile(t, a, resync+"nonMasqueradeCIDRs: [10.1.0.0/16]\n")
	b.NoApply(t, 300*time.Millisecond)
	writeFile(t, b2, resync+"nonMasqueradeCIDRs: [10.2.0.0/16]\n")
	wantNonMasq(t, b, "[10.2.0.0/16]")

	if err := os.Remove(b2); err != nil {
		t.Fatal(err)
	}
	if got := nonMasq(b.WaitApply(t)); len(got) != 3 {
		t.Fatalf("a dangling link applied %v, want the three default CIDRs", got)
	}
}

// TestConfigMapSwapsFollowed: ConfigMap updates one after the other, each swapping "..data" to
// a new directory and removing the previous one as the kubelet does, are each applied, within
// a fraction of a second.
func TestConfigMapSwapsFollowed(t *testing.T) {
	cm := newConfigMap(t)
	cm.write("resyncInterval: 1h\nnonMasqueradeCIDRs: [10.0.0.0/8]\n")
	b := &datapathtest.Backend{}
	r := startAgent(t, cm.path(), b)
	wantNonMasq(t, b, "[10.0.0.0/8]")
	var slowest time.Duration
	for i := 1; i <= 5; i++ {
		start := time.Now()
		cm.write(fmt.Sprintf("resyncInterval: 1h\nnonMasqueradeCIDRs: [10.%d.0.0/16]\n", i))
		wantNonMasq(t, b, fmt.Sprintf("[10.%d.0.0/16]", i))
		slowest = max(slowest, time.Since(start))
	}
	t.Logf("slowest ConfigMap update to apply: %v (debounce %v, quiet %v)", slowest, configwatch.DefaultDebounce, configwatch.DefaultQuiet)
	if slowest > 2*time.Second {
		t.Errorf("a ConfigMap update took %v to apply", slowest)
	}
	b.NoApply(t, 200*time.Millisecond)
	if s := r.agent.Stats(); s.Applies != 6 || s.ConfigErrors != 0 {
		t.Errorf("stats %+v, want 6 applies and no errors", s)
	}
}

// TestPartialWriteNotApplied: a writer that writes a document in two chunks, pausing between
// them longer than the debounce and the quiet period together, never gets the first chunk
// applied, although it is a valid document on its own: only the whole file is, once the writer
// closed it. The same through a symlink into another directory.
func TestPartialWriteNotApplied(t *testing.T) {
	for _, linked := range []bool{false, true} {
		t.Run(fmt.Sprintf("symlink=%v", linked), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ip-masq-agent")
			file := path
			if linked {
				file = filepath.Join(t.TempDir(), "real.yaml")
				if err := os.Symlink(file, path); err != nil {
					t.Fatal(err)
				}
			}
			writeFile(t, file, "nonMasqueradeCIDRs: [172.16.0.0/12]\n")
			b := &datapathtest.Backend{}
			r := startAgent(t, path, b)
			wantNonMasq(t, b, "[172.16.0.0/12]")

			f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if _, err := f.WriteString("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n"); err != nil {
				t.Fatal(err)
			}
			b.NoApply(t, 4*(configwatch.DefaultDebounce+configwatch.DefaultQuiet))
			if _, err := f.WriteString("  - 192.168.0.0/16\n"); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			wantNonMasq(t, b, "[10.0.0.0/8 192.168.0.0/16]")
			b.NoApply(t, 200*time.Millisecond)
			if s := r.agent.Stats(); s.Applies != 2 || s.Reloads != 2 || s.ConfigErrors != 0 {
				t.Errorf("stats %+v, want 2 applies and reloads, no errors", s)
			}
		})
	}
}

// TestStalledWriterTimesOut: a writer that keeps the file open without writing delays the file
// by WriterTimeout at most; then the file is read as it is, with a warning, and the writer's
// completion is applied when it comes.
func TestStalledWriterTimesOut(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	writeFile(t, path, "nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	b := &datapathtest.Backend{}
	const timeout = 300 * time.Millisecond
	r := startAgentWatching(t, path, configwatch.Options{WriterTimeout: timeout}, b)
	wantNonMasq(t, b, "[172.16.0.0/12]")

	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	wrote := time.Now()
	if _, err := f.WriteString("nonMasqueradeCIDRs: [10.0.0.0/8]\n"); err != nil {
		t.Fatal(err)
	}
	wantNonMasq(t, b, "[10.0.0.0/8]")
	if took := time.Since(wrote); took < timeout {
		t.Errorf("the open file was applied after %v, before the writer timeout %v", took, timeout)
	}
	r.waitLog(t, "the config file is still open for writing but unmodified for a while")
	if _, err := f.WriteString("masqueradeCIDRs: [10.9.0.0/16]\n"); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	p := b.WaitApply(t)
	if got := fmt.Sprint(nonMasq(p)); got != "[10.0.0.0/8]" || p.IPv4[0].Prefix.String() != "10.9.0.0/16" {
		t.Fatalf("after the writer finished applied %+v", p)
	}
}

// TestConfigDirectory: a directory of several ConfigMaps' files, projected into one volume, is
// merged; a bad file or a conflicting pair changes nothing (the last good merged configuration
// stays in force, the agent stays ready), and the next good version is applied.
func TestConfigDirectory(t *testing.T) {
	p := testutil.NewProjection(t.TempDir())
	platform := "resyncInterval: 1h\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"
	publish := func(files map[string]string) {
		t.Helper()
		if err := p.Write(files); err != nil {
			t.Fatal(err)
		}
	}
	publish(map[string]string{"ip-masq-platform": platform, "ip-masq-user": "nonMasqueradeCIDRs: [172.16.0.0/12, 10.0.0.0/8]\n"})
	b := &datapathtest.Backend{}
	r := startAgent(t, p.Dir, b)
	wantNonMasq(t, b, "[10.0.0.0/8 172.16.0.0/12]")

	publish(map[string]string{"ip-masq-platform": platform, "ip-masq-user": "nonMasqueradeCIDRs: [10.0.0.1/8]\n"})
	r.waitStats(t, "the bad file", func(s Stats) bool { return s.ConfigErrors == 1 })
	r.waitLog(t, "ip-masq-user: nonMasqueradeCIDRs[0]")
	publish(map[string]string{"ip-masq-platform": platform, "ip-masq-user": "resyncInterval: 2h\n"})
	r.waitStats(t, "the conflicting pair", func(s Stats) bool { return s.ConfigErrors == 2 })
	r.waitLog(t, `resyncInterval: \"2h0m0s\" in ip-masq-user conflicts with \"1h0m0s\" in ip-masq-platform`)
	b.NoApply(t, 100*time.Millisecond)
	if code, _ := r.ready(t); code != http.StatusOK {
		t.Errorf("after the rejections /readyz answers %d, want 200: the last good configuration is in force", code)
	}

	publish(map[string]string{"ip-masq-platform": platform})
	wantNonMasq(t, b, "[10.0.0.0/8]")
	// The backend holds the policy a moment before the agent counts the apply.
	if s := r.waitStats(t, "the second apply counted", func(s Stats) bool { return s.Applies >= 2 }); s.Applies != 2 || s.ConfigErrors != 2 {
		t.Errorf("stats %+v, want 2 applies and 2 config errors", s)
	}
}
