// Package image builds the agent's runtime image on this machine without pulling anything: a
// Debian root filesystem that mmdebstrap makes from the machine's Debian package sources, with
// the static binary added, packed as an OCI image archive that podman loads (and containerd's
// ctr imports). Given the same sources, binary and SOURCE_DATE_EPOCH, two builds are the same
// bytes, so the same digest. The Dockerfile describes the same image for users with a registry;
// a test keeps the two in step through Runtime.
package image

import (
	"archive/tar"
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	v1 "github.com/opencontainers/image-spec/specs-go/v1"
)

// Spec is what the image holds and how it starts.
type Spec struct {
	// Suite is the Debian release of the root filesystem.
	Suite string
	// Packages are installed over Debian's essential set.
	Packages []string
	// Binary is where the agent is installed: the image's entrypoint. Empty: the image has no
	// entrypoint (Cmd is the whole command).
	Binary string
	// Cmd is the image's default arguments (its whole command without Binary); none if empty.
	Cmd []string
	// User is the image's.
	User string
	// Remove are the paths (shell globs) removed from the root filesystem after the install.
	Remove []string
}

// Runtime is the agent's image: iptables (both modes) for the iptables backend and nft for the
// nftables backend (the BPF backend needs neither) on Debian's essential set, run as root, since
// the agent needs its capabilities (the DaemonSet drops every other).
var Runtime = Spec{
	Suite:    "bookworm",
	Packages: []string{"iptables", "nftables"},
	Binary:   "/usr/local/bin/ip-masq-agent",
	User:     "0:0",
	Remove:   []string{"/usr/share/doc", "/usr/share/man", "/var/cache/debconf/*-old"},
}

// Repository is where the project publishes the image; a build is tagged Repository:VERSION,
// the reference the manifests under deploy/ run.
const Repository = "ghcr.io/ip-masq-agent/ip-masq-agent"

// Options are one build's inputs.
type Options struct {
	Spec Spec
	// Binary is the agent to install (a static build, as make build makes it).
	Binary string
	// Version is the release version, for the annotations.
	Version string
	// Reference names the image in the archive, e.g. Repository + ":v0.1.0".
	Reference string
	// Epoch is every timestamp of the image (SOURCE_DATE_EPOCH).
	Epoch time.Time
	// Sources are the apt sources lines ("deb URI SUITE COMPONENT..."); empty means this
	// machine's Debian sources for the suite (see MachineSources).
	Sources []string
	// Output is the OCI archive to write.
	Output string
	// Log receives mmdebstrap's output; nil discards it.
	Log io.Writer
}

// Result identifies what a build wrote.
type Result struct {
	// Manifest is the image manifest's digest (what a registry calls the image's digest).
	Manifest digest.Digest
	// Config is the image configuration's digest: podman's and containerd's image ID.
	Config digest.Digest
	// LayerSize is the root filesystem's size, uncompressed: all the layers'.
	LayerSize int64
}

// Build writes the image as an OCI archive at opts.Output.
func Build(ctx context.Context, opts Options) (Result, error) {
	tmp, err := os.MkdirTemp(filepath.Dir(opts.Output), ".image-")
	if err != nil {
		return Result{}, err
	}
	defer os.RemoveAll(tmp)
	rootfs := filepath.Join(tmp, "rootfs.tar")
	if err := RootFS(ctx, opts, rootfs); err != nil {
		return Result{}, err
	}
	return Pack(opts, rootfs)
}

// RootFS makes the root filesystem Build packs, as a tar at out, without packing it: the
// essential set and opts.Spec.Packages from opts.Sources (this machine's if empty), opts.Binary
// at opts.Spec.Binary when opts.Binary is set, minus opts.Spec.Remove. One root filesystem can
// be the base layer of several images (Pack with more layers).
func RootFS(ctx context.Context, opts Options, out string) error {
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	if len(opts.Sources) == 0 {
		src, err := MachineSources(ctx, opts.Spec.Suite)
		if err != nil {
			return err
		}
		opts.Sources = src
	}
	return mmdebstrap(ctx, opts, out)
}

// MachineSources returns this machine's apt sources of a Debian suite and its updates and
// security suites, as apt knows them (apt-get indextargets), one "deb" line per repository.
func MachineSources(ctx context.Context, suite string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "apt-get", "indextargets", "--format", "$(SITE) $(RELEASE) $(COMPONENT)", "Identifier: Packages").Output()
	if err != nil {
		return nil, fmt.Errorf("apt-get indextargets: %w", err)
	}
	return sourcesOf(string(out), suite)
}

func sourcesOf(indextargets, suite string) ([]string, error) {
	type repo struct{ site, release string }
	components := map[repo][]string{}
	for _, line := range strings.Split(indextargets, "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || !slices.Contains([]string{suite, suite + "-updates", suite + "-security"}, f[1]) {
			continue
		}
		r := repo{f[0], f[1]}
		if !slices.Contains(components[r], f[2]) {
			components[r] = append(components[r], f[2])
		}
	}
	var out []string
	for r, cs := range components {
		slices.Sort(cs)
		out = append(out, fmt.Sprintf("deb %s %s %s", r.site, r.release, strings.Join(cs, " ")))
	}
	slices.Sort(out)
	if !slices.ContainsFunc(out, func(s string) bool { return strings.Fields(s)[2] == suite }) {
		return nil, fmt.Errorf("this machine has no apt source of Debian %s (apt-get indextargets lists none): add one, or give the sources", suite)
	}
	return out, nil
}

// mergedUsrHook makes /bin, /lib and /sbin links into /usr from the start, as Debian does since
// bookworm; without it the usrmerge package does so and drags in perl (about 70 MB more).
const mergedUsrHook = "/usr/share/mmdebstrap/hooks/merged-usr"

// mmdebstrap makes the root filesystem as a tar: the essential set, the spec's packages, the
// binary (if any), minus the spec's removals; reproducible under SOURCE_DATE_EPOCH.
func mmdebstrap(ctx context.Context, opts Options, out string) error {
	s := opts.Spec
	remove := make([]string, len(s.Remove))
	for i, r := range s.Remove {
		remove[i] = `"$1"` + r
	}
	args := []string{"--variant=essential", "--include=" + strings.Join(s.Packages, ","),
		"--hook-dir=" + mergedUsrHook}
	if opts.Binary != "" {
		args = append(args, "--customize-hook=upload "+opts.Binary+" "+s.Binary,
			"--customize-hook=chmod 0755 \"$1\""+s.Binary)
	}
	if len(remove) > 0 {
		args = append(args, "--customize-hook=rm -rf "+strings.Join(remove, " "))
	}
	args = append(args, s.Suite, out)
	args = append(args, opts.Sources...)
	cmd := exec.CommandContext(ctx, "mmdebstrap", args...)
	cmd.Env = append(os.Environ(), fmt.Sprintf("SOURCE_DATE_EPOCH=%d", opts.Epoch.Unix()))
	cmd.Stdout, cmd.Stderr = opts.Log, opts.Log
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("mmdebstrap %s: %w", strings.Join(args, " "), err)
	}
	return nil
}

// Pack writes the OCI archive at opts.Output: the layers (tars, the root filesystem first, each
// later one laid over the ones before), the image configuration (entrypoint opts.Spec.Binary,
// arguments opts.Spec.Cmd, user opts.Spec.User), the manifest, and the index naming it
// opts.Reference. Build packs what mmdebstrap made; the cluster tests pack a pause image of one
// static binary, and the e2e images a root filesystem with a layer of WriteLayer's on top.
func Pack(opts Options, layers ...string) (Result, error) {
	if len(layers) == 0 {
		return Result{}, errors.New("pack: no layer")
	}
	descs := make([]v1.Descriptor, len(layers))
	for i, l := range layers {
		d, size, err := fileDigest(l)
		if err != nil {
			return Result{}, err
		}
		descs[i] = v1.Descriptor{MediaType: v1.MediaTypeImageLayer, Digest: d, Size: size}
	}
	blobs, res, err := describe(opts, descs)
	if err != nil {
		return Result{}, err
	}
	return res, writeArchive(opts.Output, opts.Epoch.UTC(), blobs, descs, layers)
}

// file is one small file of the archive.
type file struct {
	name string
	data []byte
}

// describe makes the image's JSON documents for its layers (uncompressed, so each digest is
// also the diff ID): the configuration, the manifest, the index and the layout marker.
func describe(opts Options, layers []v1.Descriptor) ([]file, Result, error) {
	epoch := opts.Epoch.UTC()
	platform := v1.Platform{Architecture: runtime.GOARCH, OS: "linux"}
	var entrypoint []string
	if opts.Spec.Binary != "" {
		entrypoint = []string{opts.Spec.Binary}
	}
	diffIDs := make([]digest.Digest, len(layers))
	history := make([]v1.History, len(layers))
	var size int64
	for i, l := range layers {
		diffIDs[i] = l.Digest
		history[i] = v1.History{Created: &epoch, CreatedBy: fmt.Sprintf("layer %d of %s", i+1, opts.Reference)}
		size += l.Size
	}
	history[0].CreatedBy = fmt.Sprintf("mmdebstrap --variant=essential --include=%s %s; %s %s",
		strings.Join(opts.Spec.Packages, ","), opts.Spec.Suite, opts.Spec.Binary, opts.Version)
	config, err := json.Marshal(v1.Image{
		Created:  &epoch,
		Platform: platform,
		Config: v1.ImageConfig{
			User:       opts.Spec.User,
			Entrypoint: entrypoint,
			Cmd:        opts.Spec.Cmd,
			Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		},
		RootFS:  v1.RootFS{Type: "layers", DiffIDs: diffIDs},
		History: history,
	})
	if err != nil {
		return nil, Result{}, err
	}
	configDesc := v1.Descriptor{MediaType: v1.MediaTypeImageConfig, Digest: digest.FromBytes(config), Size: int64(len(config))}
	manifest, err := json.Marshal(v1.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: v1.MediaTypeImageManifest,
		Config:    configDesc,
		Layers:    layers,
		Annotations: map[string]string{
			v1.AnnotationCreated: epoch.Format(time.RFC3339),
			v1.AnnotationVersion: opts.Version,
		},
	})
	if err != nil {
		return nil, Result{}, err
	}
	manifestDesc := v1.Descriptor{MediaType: v1.MediaTypeImageManifest, Digest: digest.FromBytes(manifest), Size: int64(len(manifest)),
		Platform:    &platform,
		Annotations: refAnnotations(opts.Reference)}
	index, err := json.Marshal(v1.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: v1.MediaTypeImageIndex,
		Manifests: []v1.Descriptor{manifestDesc}})
	if err != nil {
		return nil, Result{}, err
	}
	layout, err := json.Marshal(v1.ImageLayout{Version: v1.ImageLayoutVersion})
	if err != nil {
		return nil, Result{}, err
	}
	files := []file{{"oci-layout", layout}, {"index.json", index}, {blobPath(manifestDesc.Digest), manifest}, {blobPath(configDesc.Digest), config}}
	return files, Result{Manifest: manifestDesc.Digest, Config: configDesc.Digest, LayerSize: size}, nil
}

// refAnnotations name an index's manifest: for podman (the OCI annotation) and for containerd's
// import (its own).
func refAnnotations(reference string) map[string]string {
	return map[string]string{v1.AnnotationRefName: reference, "io.containerd.image.name": reference}
}

func blobPath(d digest.Digest) string { return path.Join("blobs", d.Algorithm().String(), d.Encoded()) }

// writeArchive writes the OCI layout as a tar, every entry owned by root and stamped epoch:
// the files, then each layer's blob from its tar.
func writeArchive(out string, epoch time.Time, files []file, descs []v1.Descriptor, layers []string) error {
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	defer f.Close()
	w := bufio.NewWriterSize(f, 1<<20)
	tw := tar.NewWriter(w)
	header := func(name string, size int64) *tar.Header {
		if strings.HasSuffix(name, "/") {
			return &tar.Header{Name: name, Mode: 0o755, ModTime: epoch, Typeflag: tar.TypeDir, Format: tar.FormatPAX}
		}
		return &tar.Header{Name: name, Size: size, Mode: 0o644, ModTime: epoch, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(header(d, 0)); err != nil {
			return err
		}
	}
	for _, e := range files {
		if err := tw.WriteHeader(header(e.name, int64(len(e.data)))); err != nil {
			return err
		}
		if _, err := tw.Write(e.data); err != nil {
			return err
		}
	}
	written := map[digest.Digest]bool{}
	for i, l := range layers {
		if written[descs[i].Digest] {
			continue // the same layer twice: one blob
		}
		written[descs[i].Digest] = true
		if err := copyBlob(tw, header(blobPath(descs[i].Digest), descs[i].Size), l); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	return f.Close()
}

// copyBlob writes the file src into tw under h, checking that its size is still h.Size.
func copyBlob(tw *tar.Writer, h *tar.Header, src string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	if _, err := io.Copy(tw, f); err != nil {
		return fmt.Errorf("layer %s: %w", src, err)
	}
	return nil
}

func fileDigest(name string) (digest.Digest, int64, error) {
	f, err := os.Open(name)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	if n == 0 {
		return "", 0, fmt.Errorf("layer %s is empty", name)
	}
	return digest.NewDigest(digest.SHA256, h), n, nil
}
