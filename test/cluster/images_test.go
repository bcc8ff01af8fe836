package cluster

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
)

// PreviousCommit stands for the previous release in the rolling-update tests: the repository
// has no release tags yet, so it is the last commit before the cluster tests existed.
const PreviousCommit = "2da51d507e60c04c5dc1c76900318cf01d58ee97"

// PreviousTag is the previous release's image tag.
const PreviousTag = "previous-2da51d5"

// buildPreviousImage builds the agent at PreviousCommit (a temporary git worktree of this
// repository, removed afterwards), loads that commit's chart, and makes its image from the
// current one: the same root filesystem with that binary in the agent's place, packed by
// image.Pack as PreviousTag. The
// image's Debian layer is what image.Runtime installs, unchanged since that commit, so a second
// mmdebstrap run would only make the same bytes again, a minute later.
func buildPreviousImage(ctx context.Context, t *testing.T, current agentImage) agentImage {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	git := func(args ...string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, "git", append([]string{"-C", root}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %s: %v: %s (the rolling-update tests need this repository's history)", strings.Join(args, " "), err, out)
		}
	}
	// A shallow clone lacks the commit: fetch it from where the clone came from.
	if exec.CommandContext(ctx, "git", "-C", root, "cat-file", "-e", PreviousCommit+"^{commit}").Run() != nil {
		git("fetch", "--quiet", "origin", PreviousCommit)
	}
	git("worktree", "add", "--detach", src, PreviousCommit)
	defer git("worktree", "remove", "--force", src)
	bin := filepath.Join(dir, "ip-masq-agent")
	build := exec.CommandContext(ctx, "go", "build", "-trimpath",
		"-ldflags=-s -w -X github.com/ip-masq-agent/ip-masq-agent/pkg/version.Version="+current.version+
			" -X github.com/ip-masq-agent/ip-masq-agent/pkg/version.Commit="+PreviousCommit,
		"-o", bin, "./cmd/ip-masq-agent")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the agent at %s: %v: %s", PreviousCommit, err, out)
	}
	ch := loadChartAt(t, src)
	rootfs := filepath.Join(dir, "rootfs.tar")
	if err := replaceInLayer(current.archive, rootfs, image.Runtime.Binary, bin); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "previous.tar")
	if _, err := image.Pack(image.Options{Spec: image.Runtime, Version: current.version,
		Reference: image.Repository + ":" + PreviousTag, Epoch: time.Unix(1, 0), Output: out}, rootfs); err != nil {
		t.Fatal(err)
	}
	return agentImage{archive: out, version: current.version, tag: PreviousTag, chart: ch}
}

// replaceInLayer writes the root filesystem of the one-layer OCI archive src to out, with the
// file at path replaced by the file with.
func replaceInLayer(src, out, path, with string) error {
	layer, err := largestBlob(src)
	if err != nil {
		return err
	}
	data, err := os.ReadFile(with)
	if err != nil {
		return err
	}
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			return fmt.Errorf("%s: no blob %s: %w", src, layer, err)
		}
		if h.Name == layer {
			break
		}
	}
	o, err := os.Create(out)
	if err != nil {
		return err
	}
	defer o.Close()
	lr, lw := tar.NewReader(tr), tar.NewWriter(o)
	replaced := false
	for {
		h, err := lr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		var body io.Reader = lr
		if strings.TrimPrefix(h.Name, ".") == path {
			h.Size, body, replaced = int64(len(data)), strings.NewReader(string(data)), true
		}
		if err := lw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := io.Copy(lw, body); err != nil {
			return err
		}
	}
	if !replaced {
		return fmt.Errorf("%s: the layer has no %s", src, path)
	}
	if err := lw.Close(); err != nil {
		return err
	}
	return o.Close()
}

// largestBlob names the archive's largest blob: the layer of a one-layer image.
func largestBlob(archive string) (string, error) {
	f, err := os.Open(archive)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	name, size := "", int64(-1)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(h.Name, "blobs/") && h.Typeflag == tar.TypeReg && h.Size > size {
			name, size = h.Name, h.Size
		}
	}
	if name == "" {
		return "", fmt.Errorf("%s holds no blob", archive)
	}
	return name, nil
}
