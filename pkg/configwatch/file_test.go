package configwatch

import (
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
