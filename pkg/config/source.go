package config

import (
	"context"
	"errors"
	"sync"
)

// Source is where the agent's configuration comes from: a file (configwatch.File) or any other
// place that can tell when it changed. The agent's loop loads it at startup, after each change it
// reports, and at every resync and retry.
type Source interface {
	// Watch starts watching. The channel receives a value whenever the configuration may have
	// changed and is to be loaded again (bursts of changes already settled), and is closed once
	// the source has stopped, after ctx is done. Watch is called once, before the first Load,
	// so that no change between the two is missed.
	Watch(ctx context.Context) (<-chan struct{}, error)
	// Load reads and parses the configuration. A configuration that cannot be read whole yet (a
	// file being written) is an error wrapping ErrUnsettled: the source reports a change when
	// it is time to load again. Any other error is a configuration to reject, naming what is
	// wrong.
	Load() (Config, error)
	// String names the source for logs, such as the file's path.
	String() string
}

// Changes is the channel a Source's Watch returns, and how the source fills it: one pending
// report stands for any number, and Stop closes it once the source has stopped (a report after
// that is dropped). Safe for concurrent use.
type Changes struct {
	mu      sync.Mutex
	c       chan struct{}
	stopped bool
}

// NewChanges returns an open channel of changes.
func NewChanges() *Changes { return &Changes{c: make(chan struct{}, 1)} }

// C is the channel Watch returns.
func (c *Changes) C() <-chan struct{} { return c.c }

// Notify reports a change.
func (c *Changes) Notify() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return
	}
	select {
	case c.c <- struct{}{}:
	default:
	}
}

// Stop closes the channel; it is called once.
func (c *Changes) Stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopped = true
	close(c.c)
}

// ErrUnsettled is what Source.Load returns, wrapped, while the configuration is being written.
var ErrUnsettled = errors.New("the configuration is being written")

// ErrUnavailable is what Source.Load returns, wrapped with why, while the source has no
// configuration to give yet: one read from the API server before the server first answered,
// or while it refuses. The source reports a change once it has one.
var ErrUnavailable = errors.New("no configuration read yet")

// Revision is the version of the object a configuration was read from: an API object's
// resourceVersion, and its generation where the API server keeps one (custom resources).
type Revision struct {
	ResourceVersion string
	Generation      int64
}

// Revisioned is implemented by sources that read versioned objects: Revision is that of what
// the last Load read (zero for no object: the defaults).
type Revisioned interface {
	Revision() Revision
}

// Reachable is implemented by sources that can lose their way to the configuration (the API
// server): Unreachable says why they cannot read it now, nil while they can. What they read
// last stays what Load returns meanwhile.
type Reachable interface {
	Unreachable() error
}

// Deletable is implemented by sources that read one API object, whose deletion is not an
// instruction: Deleted is true while the object the source read is gone, and Load meanwhile
// returns ErrUnavailable, so that the configuration in force stays. An object with an empty
// configuration is how an operator asks for the defaults.
type Deletable interface {
	Deleted() bool
}
