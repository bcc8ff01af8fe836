package configwatch

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// TestUnsettled: when a read may have caught a file half-written, and when to read again.
func TestUnsettled(t *testing.T) {
	f, err := NewFile("/etc/config/ip-masq-agent", Options{Quiet: 100 * time.Millisecond, WriterTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	old := config.File{ModTime: now.Add(-time.Minute)}
	for _, c := range []struct {
		name      string
		f         config.File
		writing   bool
		lastWrite time.Time
		want      time.Duration
	}{
		{"whole", old, false, time.Time{}, 0},
		{"missing", config.File{Missing: true}, true, now, 0},
		{"just modified", config.File{ModTime: now.Add(-30 * time.Millisecond)}, false, time.Time{}, 70 * time.Millisecond},
		{"modified in the future", config.File{ModTime: now.Add(time.Hour)}, false, time.Time{}, 0},
		{"torn", config.File{ModTime: now.Add(-time.Minute), Torn: true}, false, time.Time{}, 100 * time.Millisecond},
		{"open writer", old, true, now.Add(-200 * time.Millisecond), 800 * time.Millisecond},
		{"stalled writer", old, true, now.Add(-2 * time.Second), 0},
		{"stalled writer, just modified", config.File{ModTime: now.Add(-10 * time.Millisecond)}, true, now.Add(-2 * time.Second), 90 * time.Millisecond},
		// A ConfigMap's file was written whole before the "..data" swap made it visible.
		{"published just now", config.File{ModTime: now.Add(-time.Millisecond), Published: true}, false, time.Time{}, 0},
		{"published but torn", config.File{ModTime: now.Add(-time.Millisecond), Published: true, Torn: true}, false, time.Time{}, 100 * time.Millisecond},
	} {
		got, why := f.unsettled(c.f, c.writing, c.lastWrite, now)
		if got != c.want || (got > 0) != (why != "") {
			t.Errorf("%s: read again in %v (%q), want %v", c.name, got, why, c.want)
		}
	}
}

// TestOtherFilesOfTheTargetDirectory: a config file that links into another directory (/dev,
// /etc) is reloaded for changes of the file it leads to, not for every other file written
// there.
func TestOtherFilesOfTheTargetDirectory(t *testing.T) {
	dir, target := t.TempDir(), t.TempDir()
	real := filepath.Join(target, "real.yaml")
	writeFile(t, real, "masqOutBound: false\n")
	path := filepath.Join(dir, "ip-masq-agent")
	if err := os.Symlink(real, path); err != nil {
		t.Fatal(err)
	}
	f, err := NewFile(path, Options{Quiet: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changes, err := f.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		writeFile(t, filepath.Join(target, "other"), fmt.Sprint(i))
	}
	select {
	case <-changes:
		t.Fatal("another file of the directory the config file links into was taken for a change")
	case <-time.After(10 * DefaultDebounce):
	}
	writeFile(t, real, "masqOutBound: true\n")
	select {
	case <-changes:
	case <-time.After(10 * time.Second):
		t.Fatal("the change of the file was not reported")
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}
